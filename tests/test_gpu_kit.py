"""`make gpu-check` as far as a CPU goes: the refusal without CUDA, the installer without network,
the report on constructed results, and gloo's host staging of CUDA tensors (on CPU tensors)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ultrascale.testing import gpu_kit
from ultrascale.testing.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _check(*args, **env):
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_PYTHON": sys.executable, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_the_check_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "report"
    p = _check(str(out))
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and "no CUDA device is visible" in p.stderr, p.stderr
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("args,env,says", [
    ((), {}, "no report directory given"),
    (("{tmp}/file/report",), {}, "cannot write the report under"),
    (("{tmp}/r",), {"GPU_PYTHON": "no-such-python"}, "no no-such-python here"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, env, says):
    (tmp_path / "file").write_text("")
    p = _check(*(a.format(tmp=tmp_path) for a in args), **env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()


def _wheel(folder, name, version, module):
    """A minimal pure-Python wheel that installs `module` (a stand-in for what the GPU machine lacks)."""
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", "WHO = 'from the wheel'\n")
        z.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist_info}/RECORD", "")
    return path


def test_the_installer_adds_only_what_is_missing_without_network(tmp_path, monkeypatch):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "pytest", "0.0.1", "not_pytest")  # present on this machine: must not be installed
    _wheel(wheels, "torchao", "0.0.1", "kit_torchao_stand_in")
    venv = tmp_path / "venv"
    # A venv that sees this one's packages (its torch, pytest...) through a .pth file, as a GPU
    # machine's Python has its own; torchao is made to look missing below.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    import sysconfig

    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "_machine.pth").write_text(sysconfig.get_path("purelib") + "\n")
    py = str(venv / "bin" / "python")
    have = {n: gpu_kit.installed(n) for n, _ in gpu_kit.KIT}
    missing = [n for n in gpu_kit.needed() if have[n] is None]
    script = ("import sys; from importlib import metadata; from ultrascale.testing import gpu_kit as k; "
              "real = k.installed; k.installed = lambda n: None if n == 'torchao' else real(n); "
              "todo, missing = k.plan_install(sys.argv[1]); print(([w.name for w in todo], missing))")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PIP_NO_INDEX="1")
    plan = subprocess.run([py, "-c", script, str(wheels)], capture_output=True, text=True, env=env, check=True)
    assert plan.stdout.strip() == str((["torchao-0.0.1-py3-none-any.whl"], [m for m in missing if m != "torchao"]))
    if missing and missing != ["torchao"]:
        pytest.skip(f"this machine lacks {missing}: the install step below would refuse")
    # The real install: pip with no index, no dependencies, from the folder only, into a directory of its
    # own that goes on PYTHONPATH; the venv's site-packages stay as they were.
    target = tmp_path / "site"
    before = sorted(p.name for p in site.iterdir())
    run = ("import sys; from ultrascale.testing import gpu_kit as k; real = k.installed; "
           "k.installed = lambda n: None if n == 'torchao' else real(n); sys.exit(k.install(*sys.argv[1:]))")
    p = subprocess.run([py, "-c", run, str(wheels), str(target)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert sorted(p.name for p in site.iterdir()) == before
    env["PYTHONPATH"] += os.pathsep + str(target)
    got = subprocess.run([py, "-c", "import kit_torchao_stand_in as m, pytest; print(m.WHO, pytest.__version__)"],
                         capture_output=True, text=True, env=env, check=True).stdout.split()
    assert got[:3] == ["from", "the", "wheel"] and got[3] == have["pytest"]  # the machine's pytest kept


def test_the_installer_names_what_neither_the_machine_nor_the_folder_has(tmp_path, capsys):
    todo, missing = gpu_kit.plan_install(str(tmp_path), have=lambda n: None if n == "torchao" else "1")
    assert todo == [] and missing == ["torchao"]
    assert gpu_kit.needed((3, 10)) == gpu_kit.needed((3, 11)) + ["exceptiongroup", "tomli"] or \
        set(gpu_kit.needed((3, 10))) - set(gpu_kit.needed((3, 11))) == {"exceptiongroup", "tomli"}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_a" time="1.5"><properties>
<property name="equivalence" value="dp 2, 2 ranks on one GPU (gloo): 3 steps, loss rel 1.0e-07"/></properties></testcase>
<testcase classname="tests.test_gpu" name="test_b" time="2.0"><failure message="assert 0.2 &lt;= 0.1&#10;more">x</failure></testcase>
<testcase classname="tests.test_gpu" name="test_c" time="0.0"><skipped message="no torchao"/></testcase>
</testsuite></testsuites>"""


def test_the_report_gathers_every_part_whatever_happened(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (tmp_path / "environment.json").write_text(json.dumps(
        {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3"}))
    status = {"tests": ("failed", 1), "bench-gpu": ("passed", 0), "bench-hf": ("timeout", 124)}
    for name, (s, rc) in status.items():
        part = {"name": name, "status": s, "rc": rc, "seconds": 12.0, "timeout_s": 90, "command": f"run {name}"}
        if name == "tests":
            part["junit"] = "parts/tests.xml"
        (parts / f"{name}.status.json").write_text(json.dumps(part))
        (parts / f"{name}.log").write_text(f"log of {name}\n")
    (parts / "tests.xml").write_text(JUNIT)
    (parts / "bench-gpu.json").write_text(json.dumps({"summary": {"mfu": 0.4213, "tokens_per_s": 51234.5}}))
    assert gpu_kit.main(["report", str(tmp_path)]) == 1  # not everything passed
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert [p["name"] for p in report["parts"]] == ["bench-gpu", "bench-hf", "tests"]
    tests = next(p for p in report["parts"] if p["name"] == "tests")["tests"]
    assert [(t["name"], t["outcome"]) for t in tests] == [("test_a", "passed"), ("test_b", "failed"),
                                                          ("test_c", "skipped")]
    assert tests[1]["message"] == "assert 0.2 <= 0.1"
    md = (tmp_path / "gpu-report.md").read_text()
    assert md.startswith("# gpu-check: NVIDIA H100 80GB HBM3\n") and "torch 2.11.0+cu130, CUDA 13.0" in md
    assert "| bench-hf | timeout | 12 | 90 | `run bench-hf` |" in md and "- mfu: 0.4213" in md
    assert "- dp 2, 2 ranks on one GPU (gloo): 3 steps, loss rel 1.0e-07" in md
    assert "log of bench-hf" in md and "log of bench-gpu" not in md  # logs of what did not pass only


def test_the_equivalence_lines_reach_the_junit_file_pytest_writes(tmp_path):
    # The report's "Tolerance reached" lines come from the file pytest itself writes, with this
    # suite's conftest.py: one property per line a test added to compare.REPORT.
    (tmp_path / "conftest.py").write_text((Path(ROOT) / "tests" / "conftest.py").read_text())
    (tmp_path / "test_lines.py").write_text(
        "from ultrascale.testing import compare\n"
        "def test_a():\n    compare.REPORT += ['dp 2: loss rel 1.0e-07', 'tp 2: loss rel 2.0e-07']\n"
        "def test_b():\n    compare.REPORT.append('pp 2: loss rel 3.0e-07')\n    assert False\n")
    xml = tmp_path / "tests.xml"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--junitxml", str(xml), "test_lines.py"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stdout[-2000:]  # test_b fails, and its line is kept all the same
    cases = gpu_kit.read_junit(str(xml))
    assert [(c["name"], c["outcome"], c["equivalence"]) for c in cases] == [
        ("test_a", "passed", ["dp 2: loss rel 1.0e-07", "tp 2: loss rel 2.0e-07"]),
        ("test_b", "failed", ["pp 2: loss rel 3.0e-07"])]
    assert "dp 2: loss rel 1.0e-07\ntp 2: loss rel 2.0e-07\npp 2: loss rel 3.0e-07" in p.stdout  # the summary


# -- gloo carrying device tensors through host copies (here: CPU tensors, staged all the same) ----
def _staged_collectives():
    from ultrascale.distributed import collectives
    from ultrascale.testing import gloo_cuda

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    calls = []

    class Counted(gloo_cuda._Staged):
        def __init__(self, work, host, target):
            calls.append("recv" if target is not None else "send")
            super().__init__(work, host, target)

    with mock.patch.object(gloo_cuda, "_Staged", Counted), gloo_cuda.staged(stage_cpu=True):
        ring = torch.full((4,), float(rank))
        got = torch.empty(4)
        collectives._exchange(ring, peer, got, peer, None)  # P2POp + batch_isend_irecv
        x = torch.arange(3.0) + 10 * rank
        if rank == 0:
            dist.send(x, 1)
            w = dist.isend(x * 2, 1, tag=3)
            w.wait()
            back = torch.empty(3)
            dist.recv(back, 1)
        else:
            back = torch.empty(3)
            dist.recv(back, 0)
            twice = torch.empty(3)
            dist.irecv(twice, 0, tag=3).wait()
            back = back + twice
            dist.send(back, 0)
        parts = [torch.empty(2) for _ in range(world)]
        dist.all_gather(parts, torch.full((2,), float(rank)))
        a2a = torch.empty(world)
        dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
    return got.tolist(), back.tolist(), [p.tolist() for p in parts], a2a.tolist(), calls


def test_staged_collectives_deliver_what_gloo_would():
    r0, r1 = run_distributed(2, _staged_collectives)
    assert r0[0] == [1.0] * 4 and r1[0] == [0.0] * 4
    assert r0[1] == [0.0, 3.0, 6.0]  # rank 1 got x and 2x from rank 0 and sent back their sum
    assert r0[2] == r1[2] == [[0.0, 0.0], [1.0, 1.0]]
    assert r0[3] == [0.0, 10.0] and r1[3] == [1.0, 11.0]
    # Through host copies: the ring's pair, the isend / irecv pair, the gathers (none waited on: no request).
    assert r0[4] == ["send", "recv", "send"] and r1[4] == ["send", "recv", "recv"]


def test_a_test_run_stopped_at_its_limit_still_reports_what_ended(tmp_path):
    # Killed by `timeout`, pytest writes no junit file: the outcomes -v printed as each test ended remain.
    parts = tmp_path / "parts"
    parts.mkdir()
    part = {"name": "tests", "status": "timeout", "rc": 124, "seconds": 250.0, "timeout_s": 250,
            "command": "pytest", "junit": "parts/tests.xml"}
    (parts / "tests.status.json").write_text(json.dumps(part))
    (parts / "tests.log").write_text(
        "tests/test_gpu.py::test_one_process_on_cuda_equals_cpu PASSED [ 10%]\n"
        "tests/test_gpu.py::test_layouts[dp2] FAILED [ 20%]\n"
        "tests/test_gpu.py::test_fp8 SKIPPED (no torchao) [ 30%]\n"
        "tests/test_gpu.py::test_compile \n")
    assert gpu_kit.main(["report", str(tmp_path)]) == 1
    tests = json.loads((tmp_path / "gpu-report.json").read_text())["parts"][0]["tests"]
    assert [(t["name"], t["outcome"]) for t in tests] == [
        ("test_one_process_on_cuda_equals_cpu", "passed"), ("test_layouts[dp2]", "failed"), ("test_fp8", "skipped")]
