import os

# Several gloo processes share this machine's cores: one thread each (also for this process's reference runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    from ultrascale.testing.compare import REPORT

    if REPORT:
        import torch

        kernels = torch.backends.cpu.get_cpu_capability()
        terminalreporter.section(f"equivalence with the single-process run (tolerance reached, {kernels} kernels)")
        for line in REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    from ultrascale.testing.harness import shutdown_pools

    shutdown_pools()
