"""benchmarks/bench_peers.py's arithmetic and its page writing, on constructed results.

Nothing is timed: the step times below are made up, and every expected figure is worked out
by hand from them (the measured table is docs/benchmarks.md's, written by the script).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(BENCH))  # the script imports its neighbour _common
    try:
        spec = importlib.util.spec_from_file_location("bench_peers", BENCH / "bench_peers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_peers"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_peers", None)
        sys.path.remove(str(BENCH))


def test_speed_is_the_peers_time_over_ours_paired_by_round(peers):
    # Two rounds of two steps. Round means: ours 1.0, 2.0; peer 2.0, 2.0 -> per round 2.0 and 1.0, median 1.5.
    # Medians: peer 2.0 over ours (1 + 2) / 2 = 1.5 -> 4/3. Above 1: ours is faster.
    paired, medians, rounds = peers.speed([1.0, 1.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0], steps=2)
    assert paired == pytest.approx(1.5) and rounds == pytest.approx([2.0, 1.0])
    assert medians == pytest.approx(4 / 3)
    # The same pair the other way round reads below 1 (a swapped direction would not).
    paired, _, _ = peers.speed([2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0], steps=2)
    assert paired == pytest.approx(0.75)


def test_rows_from_the_data_parallel_json(peers):
    # The shape bench_data_parallel.py writes: per phase, rows naming their peer by label.
    res = {"spec": {"steps": 1}, "results": [{"world": 2, "phase": "dp", "rows": [
        {"key": "bucket", "runner": "ours bucket", "step_times_s": [0.5, 0.5, 0.5], "peer": "PyTorch DDP",
         "loss_max_rel_diff_vs_peer": 2e-6},
        {"key": "ddp", "runner": "PyTorch DDP", "step_times_s": [0.5, 0.6, 0.4]},
    ]}]}
    (row,) = peers.rows_dp(res)
    assert (row.technique, row.ours, row.peer, row.ranks) == ("data parallel", "bucket", "PyTorch DDP", 2)
    assert row.paired == pytest.approx(1.0)  # rounds 1.0, 1.2, 0.8
    assert row.loss_diff == 2e-6 and row.goal == pytest.approx(1 / 1.05)


def test_one_process_rows_pair_each_trainer_with_transformers(peers):
    # bench_single_vs_hf.py's shape; transformers is found by name wherever its row stands.
    res = {"args": {"steps": 1}, "results": [{"loss_max_rel_diff_ours_vs_hf": 1e-6, "rows": [
        {"shape": "small", "runner": "transformers 5 LlamaForCausalLM (sdpa)", "step_times_s": [0.3, 0.3]},
        {"shape": "small", "runner": "ultrascale", "step_times_s": [0.3, 0.6]},
        {"shape": "small", "runner": "ultrascale, measure_activations=False", "step_times_s": [0.2, 0.3]},
    ]}]}
    defaults, meter_off = peers.rows_hf(res)
    assert (defaults.technique, defaults.ours, defaults.peer) == (
        "one process (small)", "trainer, defaults", "transformers 5 LlamaForCausalLM (sdpa)")
    assert defaults.paired == pytest.approx(0.75)  # rounds 1.0 and 0.5
    assert meter_off.ours == "trainer, measure_activations=False"
    assert meter_off.paired == pytest.approx(1.25)  # rounds 1.5 and 1.0
    assert defaults.goal == 1.0 and defaults.loss_diff == 1e-6


def test_context_parallel_rows_pair_by_sweep(peers):
    # Two sweeps of two steps; one process 2.0 s a step, Ulysses 1.0 s, ring 1.0 then 2.0 (a loaded sweep).
    res = {"spec": {"steps": 2}, "rows": [
        {"cp": 1, "variant": "(one process)", "step_times_s": [2.0] * 4, "losses": [5.0, 4.0]},
        {"cp": 2, "variant": "ring", "step_times_s": [1.0, 1.0, 2.0, 2.0], "losses": [5.0, 4.0004]},
        {"cp": 2, "variant": "ulysses", "step_times_s": [1.0, 1.0, 1.0, 1.0], "losses": [5.0, 4.0]},
    ]}
    rows = {(r.ours, r.peer): r for r in peers.rows_cp(res)}
    assert set(rows) == {("ring", "one process"), ("ring", "ulysses"), ("ulysses", "one process")}
    assert rows["ring", "one process"].paired == pytest.approx(1.5)  # sweeps 2.0 and 1.0
    assert rows["ring", "ulysses"].paired == pytest.approx(0.75)  # sweeps 1.0 and 0.5
    assert rows["ring", "ulysses"].loss_diff == pytest.approx(1e-4)
    assert rows["ulysses", "one process"].paired == pytest.approx(2.0)


def test_mfu_reads_as_a_speed_against_the_ceiling_measured_in_the_same_run(peers):
    # 1,000 tokens a step of 1 MFLOP each = 1 GFLOP; the higher ceiling 0.2 TFLOP/s: 5 ms at the ceiling.
    # Steps of 10 and 20 ms: rounds 0.5 and 0.25, median 0.375 (the MFU of the median round).
    res = {"args": {"steps": 1}, "results": [{
        "loss_max_rel_diff_ours_vs_hf": 0.0, "peaks_tflops": [0.1, 0.2], "flops_per_token": 1e6, "rows": [
            {"shape": "small", "runner": "transformers 5", "step_times_s": [0.01, 0.02]},
            {"shape": "small", "runner": "ultrascale", "step_times_s": [0.01, 0.02], "tokens_per_step": 1000}]}]}
    _, mfu = peers.rows_hf(res)
    assert (mfu.ours, mfu.goal, mfu.loss_diff) == ("trainer, defaults: MFU", 0.80, None)
    assert mfu.peer_s == pytest.approx(0.005) and mfu.paired == pytest.approx(0.375)
    assert mfu.rounds == pytest.approx([0.5, 0.25])


def test_balance_rows_set_the_slowest_ranks_attention_against_the_fastest(peers):
    res = {"spec": {"steps": 1}, "rows": [
        {"cp": 1, "variant": "(one process)", "step_times_s": [2.0], "losses": [5.0]},
        {"cp": 2, "variant": "zigzag", "step_times_s": [1.0], "losses": [5.0], "attention_s": [0.65, 0.5]},
        {"cp": 2, "variant": "allgather", "step_times_s": [1.0], "losses": [5.0], "attention_s": [0.4, 0.4]},
        {"cp": 2, "variant": "ring", "step_times_s": [1.5], "losses": [5.0], "attention_s": [0.3, 0.9]},
    ]}
    rows = {r.ours: r for r in peers.rows_cp(res)}
    zigzag, allgather = rows["zigzag: slowest rank's attention"], rows["allgather: slowest rank's attention"]
    assert zigzag.paired == pytest.approx(0.5 / 0.65) and zigzag.goal == pytest.approx(1 / 1.2)
    assert peers.verdict(zigzag) == "≥ 0.83x: missed"  # 1.3x between ranks, the goal is 1.2x
    assert allgather.paired == pytest.approx(1.0) and allgather.goal is None
    assert "ring: slowest rank's attention" not in rows  # the ring is unbalanced by design: no row


def test_experts_without_dispatch_and_the_course_rows(peers):
    ep = {"spec": {"steps": 1}, "rows": EP_JSON["rows"] + [
        {"world": 2, "runner": "dense", "step_times_s": [0.02, 0.02]},
        {"world": 2, "runner": "moe", "step_times_s": [0.04, 0.04]},
        {"world": 2, "runner": "moe, every expert on every rank (no dispatch)", "step_times_s": [0.025, 0.025]}]}
    rows = {(r.technique, r.ours): r for r in peers.rows_ep(ep)}
    assert rows["experts, ep 2", "tiny-moe"].paired == pytest.approx(0.5)
    no_dispatch = rows["experts, dp 2", "tiny-moe, no dispatch (experts replicated)"]
    assert no_dispatch.paired == pytest.approx(0.8) and no_dispatch.goal is None
    nb = {"rows": [{"notebook": "1_a.ipynb", "max_s": 4.0, "runs": [4.0]},
                   {"notebook": "12_b.ipynb", "max_s": 12.5, "runs": [12.5]}]}
    (course,) = peers.rows_nb(nb)
    assert (course.technique, course.ours, course.ranks) == ("the course (2 notebooks)", "slowest Run All: 12_b", "-")
    assert course.paired == pytest.approx(45 / 12.5) and peers.verdict(course) == "≥ 1.00x: met"
    assert peers.verdict(peers.rows_nb({"rows": [{"notebook": "9_c.ipynb", "max_s": 50.0, "runs": [50.0]}]})[0]) \
        == "≥ 1.00x: missed"


def test_table_rows_and_verdicts(peers):
    # Rounds 1.0 .. 1.4: inclusive quartiles 1.1 and 1.3.
    met = peers.Row("tensor parallel", "TP", "DTensor TP", 2, 0.5, 0.6, 1.2, 1.19, [1.4, 1.0, 1.2, 1.1, 1.3], 3e-6,
                    1 / 1.05)
    missed = peers.Row("experts, ep 2", "tiny-moe", "tiny", 2, 0.04, 0.02, 0.5, 0.52, [0.5], None, 0.7)
    header, rule, a, b = peers.table([met, missed])
    assert header.count("|") == rule.count("|") == a.count("|") == b.count("|")
    assert a == ("| tensor parallel | TP | DTensor TP | 2 | 0.500 | 0.600 | **1.20x** | 1.10-1.30 (5) | 1.19x "
                 "| ≥ 0.95x: met | 3.0e-06 |")
    assert b.endswith("| **0.50x** | 0.50-0.50 (1) | 0.52x | ≥ 0.70x: missed | - |")


def measuring(*args):
    pytest.fail("bad arguments got past the checks: the benchmarks would have run")


PAGE = "# Benchmarks\n\nintro\n\n{begin}\nold table\nmore\n{end}\n\n## Next section\n"


def test_the_table_replaces_only_what_is_between_the_markers(peers):
    page = PAGE.format(begin=peers.BEGIN, end=peers.END)
    once = peers.replace_between_markers(page, "| new | table |\n")
    assert once == PAGE.format(begin=peers.BEGIN, end=peers.END).replace("old table\nmore\n", "| new | table |\n")
    assert peers.replace_between_markers(once, "| newer |") == once.replace("| new | table |", "| newer |")


@pytest.mark.parametrize("page", [
    "# Benchmarks\n\nno markers\n",
    PAGE.format(begin="{end}", end="{begin}"),  # in the wrong order
    PAGE.format(begin="{begin}", end="{end}") + "{begin}\n",  # twice
])
def test_a_page_without_its_markers_is_refused_before_anything_runs(peers, tmp_path, capsys, monkeypatch, page):
    monkeypatch.setattr(peers, "run_suite", measuring)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(page.format(begin=peers.BEGIN, end=peers.END))
    before = doc.read_text()
    with pytest.raises(SystemExit) as e:
        peers.main(["--doc", str(doc), "--json-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bench_peers: --doc {doc}: needs the line") and "\n" not in err
    assert doc.read_text() == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, says", [
    (["--doc", "{tmp}/missing.md"], "cannot read it"),
    (["--no-doc", "--json-dir", "{tmp}/page.md"], "is a file: pass a directory"),
    (["--no-doc", "--json-dir", "{tmp}/no/such/dir"], "cannot write there"),
    (["--no-doc", "--repeats", "0"], "must be at least 1"),
    (["--no-doc", "--cp", "1"], "sizes must be at least 2"),
])
def test_bad_arguments_are_one_line_and_exit_2(peers, tmp_path, capsys, monkeypatch, args, says):
    monkeypatch.setattr(peers, "run_suite", measuring)
    (tmp_path / "page.md").write_text("x")
    with pytest.raises(SystemExit) as e:
        peers.main([a.format(tmp=tmp_path) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and err.startswith("bench_peers: ")


def fake_benchmark(written: dict):
    """subprocess.call as the script makes it, writing `written` as the benchmark's --json instead of measuring."""
    import json

    def call(argv, cwd=None):
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(written, f)
        return 0
    return call


EP_JSON = {"spec": {"steps": 1}, "rows": [  # bench_expert_parallel.py --vs-dense, two rounds per runner
    {"world": 1, "runner": "dense", "step_times_s": [0.010, 0.012]},
    {"world": 1, "runner": "moe", "step_times_s": [0.020, 0.016]},
    {"world": 1, "runner": "moe, experts one by one", "step_times_s": [0.030, 0.030]},
]}


def test_a_run_writes_its_table_between_the_markers_and_nothing_else(peers, tmp_path, monkeypatch):
    monkeypatch.setattr(peers.subprocess, "call", fake_benchmark(EP_JSON))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(PAGE.format(begin=peers.BEGIN, end=peers.END))
    peers.main(["--only", "ep", "--doc", str(doc), "--json-dir", str(tmp_path / "out")])
    head, rest = doc.read_text().split(peers.BEGIN + "\n")
    block, tail = rest.split(peers.END)
    assert head == "# Benchmarks\n\nintro\n\n" and tail == "\n\n## Next section\n"
    # Rounds 0.010/0.020 and 0.012/0.016: 0.5 and 0.75, median 0.625, quartiles (interpolated between the two)
    # 0.5625 and 0.6875; medians 0.011 / 0.018.
    assert ("| experts | tiny-moe | tiny (dense, same active FLOPs) | 1 | 0.018 | 0.011 | **0.62x** | 0.56-0.69 (2) "
            "| 0.61x | ≥ 0.70x: missed | - |") in block.splitlines()
    assert ".venv/bin/python benchmarks/bench_expert_parallel.py --vs-dense" in block
    assert "old table" not in block


def test_a_result_the_reader_cannot_parse_leaves_the_page_alone(peers, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers.subprocess, "call", fake_benchmark({"spec": {"steps": 1}, "results": []}))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(PAGE.format(begin=peers.BEGIN, end=peers.END))
    before = doc.read_text()
    with pytest.raises(SystemExit) as e:
        peers.main(["--only", "ep", "--doc", str(doc), "--json-dir", str(tmp_path / "out")])
    assert e.value.code == 1
    assert "ep: cannot read" in capsys.readouterr().err and doc.read_text() == before
