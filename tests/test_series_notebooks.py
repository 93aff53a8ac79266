"""The course notebooks themselves: in step with their sources, conforming, and runnable on a CPU.

Each notebook is executed once (kernels are slow to start), with a few common wrong
answers to its exercises appended: each check must say what is wrong with them, in
words that point at the fix.
"""

import glob
import importlib.util
import json
import os

import nbformat
import pytest

from ultrascale.series.build import GPU_TAG, build_notebook, notebook_text
from ultrascale.series.episode import Episode
from ultrascale.series.execute import run_notebook
from ultrascale.series.lint import lint_file
from ultrascale.series.outline import read_episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
PART4 = os.path.join(NOTEBOOKS, "4_data_parallelism.ipynb")
PART5 = os.path.join(NOTEBOOKS, "5_global_batch_size.ipynb")

# Wrong answers a learner might write, and what the check must say about each.
MISTAKES = {
    PART4: [
        ("1", "sums instead of averaging", "divide by the number of replicas", '''
def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
    world = len(replicas)
    for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
        loss_fn(replicas[r](xb), yb).backward()
    for params in zip(*(m.parameters() for m in replicas)):
        all_reduce_sum([p.grad for p in params])
'''),
        ("1", "averages into replica 0 only", "differs from replica 0's", '''
def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
    world = len(replicas)
    for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
        loss_fn(replicas[r](xb), yb).backward()
    for params in zip(*(m.parameters() for m in replicas)):
        params[0].grad.copy_(torch.stack([p.grad for p in params]).mean(0))
'''),
        ("2", "never writes the reduced bucket back", "torch.cat makes a copy", '''
def bucketed_all_reduce(params, cap_numel, all_reduce):
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(current)
    for bucket in buckets:
        all_reduce(torch.cat([p.grad.reshape(-1) for p in bucket]))
'''),
        ("2", "drops the last, partial bucket", "last, partial bucket", '''
def bucketed_all_reduce(params, cap_numel, all_reduce):
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
        ("2", "one bucket per layer", "by size (not per layer)", '''
def bucketed_all_reduce(params, cap_numel, all_reduce):
    for i in range(len(params) - 1, 0, -2):  # bias and weight of one layer together
        bucket = [params[i], params[i - 1]]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    ],
    PART5: [
        ("1", "returns a float", "return an int", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    return gbs_tokens / seq_len / (mbs * dp)
'''),
        ("1", "never refuses", "more GPUs than the batch can feed", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    return gbs_tokens // seq_len // (mbs * dp)
'''),
        ("2", "sums the micro-batches", "divide each micro-batch loss by grad_accum", '''
def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
    dp = len(replicas)
    for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
        for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
            loss_fn(replicas[r](xb), yb).backward()
    for params in zip(*(m.parameters() for m in replicas)):
        grads = [p.grad for p in params]
        all_reduce_sum(grads)
        for g in grads:
            g.div_(dp)
'''),
        ("2", "sums the ranks", "the all-reduce sums", '''
def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
    dp = len(replicas)
    for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
        for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
            (loss_fn(replicas[r](xb), yb) / grad_accum).backward()
    for params in zip(*(m.parameters() for m in replicas)):
        all_reduce_sum([p.grad for p in params])
'''),
    ],
}


def _probe(k, label):
    return (f"\ntry:\n    check_exercise_{k}()\nexcept AssertionError as problem:\n"
            f"    print({label!r}, 'SAYS', problem)\nelse:\n    print({label!r}, 'PASSED')\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each notebook run once, with the mistakes appended: {path: (notebook, report, {label: output})}."""
    out = {}
    for path, mistakes in MISTAKES.items():
        nb = nbformat.read(path, as_version=4)
        extended = nbformat.from_dict(json.loads(json.dumps(nb)))
        first = len(extended.cells)
        for k, label, _, source in mistakes:
            extended.cells.append(nbformat.v4.new_code_cell(source.strip() + "\n" + _probe(k, label)))
        report = run_notebook(extended, timeout=300, cwd=str(tmp_path_factory.mktemp("run")))
        said = {label: report.outputs.get(first + i, "") for i, (_, label, _, _) in enumerate(mistakes)}
        out[path] = (nb, report, said)
    return out


def load_source(path):
    spec = importlib.util.spec_from_file_location("episode_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EPISODE


def test_the_notebooks_are_built_from_their_sources():
    sources = sorted(glob.glob(os.path.join(NOTEBOOKS, "src", "[0-9]*_*.py")))
    assert [os.path.basename(s)[:-3] for s in sources] == ["4_data_parallelism", "5_global_batch_size"]
    for src in sources:
        ep = load_source(src)
        assert isinstance(ep, Episode)
        with open(os.path.join(NOTEBOOKS, ep.filename), encoding="utf-8") as f:
            text = f.read()
        assert text == notebook_text(build_notebook(ep)), f"rebuild {ep.filename}: python notebooks/src/build.py"
        assert read_episode(json.loads(text), ep.filename) == ep  # the notebook holds the whole episode


def test_the_notebooks_conform(cli):
    for path in (PART4, PART5):
        assert lint_file(path) == [], path
    code, out = cli("notebook", "check", PART4, PART5)
    assert code == 0, out
    assert out.splitlines() == [f"{PART4}: ok", f"{PART5}: ok"]


@pytest.mark.parametrize("path", [PART4, PART5])
def test_runs_top_to_bottom_on_cpu_and_the_exercises_are_sound(runs, path):
    nb, report, _ = runs[path]
    assert report.failure is None, report.failure
    gpu_cells = [i for i, c in enumerate(nb.cells) if GPU_TAG in c.metadata.get("tags", [])]
    assert report.skipped == gpu_cells
    assert [e.number for e in report.exercises] == [1, 2]
    for e in report.exercises:
        assert e.ok, e.line()
        assert e.on_starter.startswith("NotImplementedError")


def test_part4_teaches_the_averaged_all_reduce_and_no_sync(runs):
    nb, report, _ = runs[PART4]
    printed = "".join(report.outputs.values())
    assert "summed gradient / single-model gradient: 4.000" in printed
    assert "forward + backward inside no_sync: all-reduce calls after each micro-batch [0, 0, 0, 1], " \
           "full-batch gradient: True" in printed
    assert "only backward inside no_sync     : all-reduce calls after each micro-batch [1, 2, 3, 4]" in printed
    assert not any(".cuda()" in c.source for c in nb.cells if GPU_TAG not in c.metadata.get("tags", []))


def test_part5_counts_4_accumulation_steps_on_128_gpus(runs):
    _, report, _ = runs[PART5]
    printed = "".join(report.outputs.values())
    assert "4,194,304 tokens / 4096 tokens per sample = 1024 samples per step" in printed
    assert "DP =  128: GA = 1024 / (2 x 128) = 4\n" in printed
    assert "accumulated / one big batch: 4.000" in printed


@pytest.mark.parametrize("path, label, says", [(p, m[1], m[2]) for p, ms in MISTAKES.items() for m in ms])
def test_checks_say_what_is_wrong(runs, path, label, says):
    said = runs[path][2][label]
    assert f"{label} SAYS" in said, said
    assert says in said, said


@pytest.fixture
def cli(capsys):
    """`ultrascale ARGS` in this process: (exit status, stdout)."""
    from ultrascale.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        return code, capsys.readouterr().out

    return run


def test_run_command_reports_skipped_gpu_cells(tmp_path, cli):
    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_episode.json")) as f:
        d = json.load(f)
    d["sections"][0]["cells"].append({"kind": "code", "needs_gpu": True,
                                      "source": "import torch\nprint(torch.ones(1).cuda())"})
    path = tmp_path / "6_averages.ipynb"
    nb = build_notebook(Episode.from_dict(d))
    path.write_text(notebook_text(nb))
    code, out = cli("notebook", "run", "--cpu", str(path))
    assert code == 0, out
    gpu_cell = next(i for i, c in enumerate(nb.cells) if GPU_TAG in c.metadata.get("tags", []))
    assert f"{path}: skipped (needs a GPU): cell {gpu_cell}" in out
    assert f"{path}: ok," in out


def test_run_command_reports_the_failing_cell(tmp_path, cli):
    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_episode.json")) as f:
        d = json.load(f)
    d["sections"][0]["cells"].append({"kind": "code", "source": "values[0] / 0"})
    path = tmp_path / "6_averages.ipynb"
    nb = build_notebook(Episode.from_dict(d))
    path.write_text(notebook_text(nb))
    code, out = cli("notebook", "run", str(path))
    assert code == 1
    bad = next(i for i, c in enumerate(nb.cells) if c.source == "values[0] / 0")
    assert f"{path}: cell {bad} failed: ZeroDivisionError: float division by zero" in out
    assert f"{path}: FAILED," in out
