import getpass
import os
import sys
import tempfile

# Several gloo processes share this machine's cores: one thread each (also for this process's reference runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The measured matmul ceiling is kept per machine (train/peak.py): the tests keep theirs apart from the user's.
os.environ.setdefault("XDG_CACHE_HOME", os.path.join(tempfile.gettempdir(), f"ultrascale-tests-{getpass.getuser()}"))

# Inductor's on-disk cache does not tell kernel sets apart: C++ it generated with the machine's
# vector code, found again under ATEN_CPU_CAPABILITY=default, fails to compile ("'at::vec' has not
# been declared"). One cache per kernel set, for this process and the notebooks' kernels it starts.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    _cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                        f"torchinductor_{getpass.getuser()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{_cache}_{os.environ['ATEN_CPU_CAPABILITY']}"

import pytest  # noqa: E402


_REPORT: list[str] = []  # the equivalence lines of every test, gathered where the summary is written


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The lines a test added to compare.REPORT become the test's properties, one per line. Each
    # report copies the properties it is built from; the teardown report has them all: there they
    # reach the summary (from a pytest-xdist worker process too) and --junitxml's file (which
    # make gpu-check's report reads).
    compare = sys.modules.get("ultrascale.testing.compare")
    if compare is not None and compare.REPORT:
        item.user_properties.extend(("equivalence", line) for line in compare.REPORT)
        compare.REPORT.clear()
    yield


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _REPORT.extend(line for key, line in report.user_properties if key == "equivalence")


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        import torch

        kernels = torch.backends.cpu.get_cpu_capability()
        terminalreporter.section(f"equivalence with the single-process run (tolerance reached, {kernels} kernels)")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """How `make test` spreads the tests over its pytest-xdist workers (--dist loadgroup): a test
    file is one unit, run by one worker (its module fixtures built once), unless its tests name a group
    of their own (each notebook's runs, each part of the README's tour). The units marked `long` go
    first, so that the short ones fill in beside them instead of a long one running alone at the end."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_configure(config):
    # pytest-xdist's loadgroup writes each test's group into the id it sends (`_nodeid`); a pytest that reads
    # the id from elsewhere groups nothing, and every unit's module fixtures are built on both workers, twice
    # the time without a word. Asked of pytest itself, on the process that schedules, before anything runs.
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        from types import SimpleNamespace

        from _pytest.nodes import Node

        if Node.nodeid.fget(SimpleNamespace(_nodeid="test@group", _id="test")) != "test@group":
            raise pytest.UsageError(f"pytest-xdist's --dist loadgroup groups nothing under pytest {pytest.__version__}"
                                    f": install the versions of constraints.txt (make setup)")


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    from ultrascale.testing.harness import shutdown_pools

    shutdown_pools()
