"""Pipeline parallelism: the schedules as data, the simulator's formulas, and the runtime
against the single-process run on real gloo processes."""

import functools
import json
from fractions import Fraction

import pytest

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import get_preset
from ultrascale.parallel.pipeline.schedules import SCHEDULES, build, schedule
from ultrascale.parallel.pipeline.simulate import simulate
from ultrascale.testing.cli import ultrascale
from ultrascale.testing.compare import RunRecord, assert_matches, compare, train_parallel, train_single


# -- the schedules ---------------------------------------------------------------
def valid(name, p, m, v):
    return not (name == "interleaved" and m % p) and (v == 1 or name == "interleaved")


GRID = [(name, p, m, v) for name in SCHEDULES for p in (1, 2, 3, 4) for m in range(1, 9)
        for v in ((1, 2, 3) if name == "interleaved" else (1,)) if valid(name, p, m, v)]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_every_pass_runs_once_in_a_valid_order(name, p, m, v):
    for rank, acts in enumerate(build(name, p, m, v)):
        forwards = [(a.micro, a.chunk) for a in acts if a.kind == "F"]
        assert sorted(forwards) == [(k, c) for k in range(m) for c in range(v)]
        for kinds in (("B",), ("I",), ("W",)):
            done = [(a.micro, a.chunk) for a in acts if a.kind in kinds]
            assert len(done) == len(set(done))
        backward = {(a.micro, a.chunk) for a in acts if a.kind in ("B", "I")}
        assert backward == set(forwards)
        seen = set()
        for a in acts:  # a backward after its forward, a W after its I
            if a.kind == "F":
                seen.add(("F", a.micro, a.chunk))
            elif a.kind in ("B", "I"):
                assert ("F", a.micro, a.chunk) in seen
                seen.add(("I", a.micro, a.chunk))
            elif a.kind == "W":
                assert ("I", a.micro, a.chunk) in seen
    simulate(schedule(name, p, m, v), p, v)  # raises if the ranks would deadlock


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", range(1, 9))
def test_afab_and_1f1b_bubble_is_p_minus_1_over_m(p, m):
    for name in ("afab", "1f1b"):
        tl = simulate(schedule(name, p, m), p)
        assert Fraction(tl.bubble_ratio).limit_denominator(1000) == Fraction(p - 1, m), name


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8), (3, 9), (8, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v):
    tl = simulate(schedule("interleaved", p, m, v), p, v)
    assert Fraction(tl.bubble_ratio).limit_denominator(1000) == Fraction(p - 1, v * m)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_zero_bubble_h1_has_a_third_of_the_1f1b_bubble(p, m):
    zb, one = simulate(schedule("zero-bubble", p, m), p), simulate(schedule("1f1b", p, m), p)
    # Qi et al.: (p-1)(T_F + T_B - T_W) against (p-1)(T_F + T_B + T_W), with all three equal.
    assert zb.bubble_time == (p - 1) * (1 + 1 - 1)
    assert one.bubble_time == (p - 1) * (1 + 1 + 1)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 3), (8, 16)])
def test_activations_in_flight(p, m):
    afab, one = simulate(schedule("afab", p, m), p), simulate(schedule("1f1b", p, m), p)
    assert afab.peak_in_flight == [m] * p
    assert one.peak_in_flight[0] == min(p, m)
    assert one.peak_in_flight == [min(p - r, m) for r in range(p)]


def test_communication_shifts_the_timeline():
    free = simulate(schedule("1f1b", 4, 8), 4)
    slow = simulate(schedule("1f1b", 4, 8), 4, t_comm=0.5)
    assert slow.makespan > free.makespan


def test_a_deadlocking_schedule_is_caught():
    from ultrascale.parallel.pipeline.schedules import Action, with_communication

    # Rank 0 waits for a gradient before sending the forward the last rank needs to produce it.
    acts = [[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(with_communication(acts, 2, 1), 2)


# -- the runtime against one process ------------------------------------------------
def config(world, pp, name, m, v=1, tp=1, zero=0, steps=2):
    p = ParallelConfig(dp=world // (pp * tp), pp=pp, tp=tp, pp_schedule=name, pp_chunks=v, zero=zero,
                       bucket_mb=0.05)
    t = TrainConfig(steps=steps, seq_len=16, micro_batch=1, grad_accum=m, seed=11, progress=False)
    return RunConfig(model=get_preset("tiny", layers=8), parallel=p, train=t)


@functools.lru_cache(maxsize=None)
def reference(global_batch):
    cfg = config(1, 1, "1f1b", 1)
    t = cfg.train
    import dataclasses

    return RunRecord.of(train_single(dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch=global_batch))))


RUNS = [  # (world, pp, schedule, m, v, tp, zero)
    (2, 2, "naive", 3, 1, 1, 0), (2, 2, "afab", 1, 1, 1, 0), (2, 2, "afab", 5, 1, 1, 0),
    (2, 2, "1f1b", 1, 1, 1, 0), (2, 2, "1f1b", 3, 1, 1, 0), (2, 2, "1f1b", 8, 1, 1, 0),
    (2, 2, "interleaved", 2, 2, 1, 0), (2, 2, "interleaved", 6, 2, 1, 0),
    (2, 2, "zero-bubble", 1, 1, 1, 0), (2, 2, "zero-bubble", 4, 1, 1, 0),
    (4, 4, "afab", 4, 1, 1, 0), (4, 4, "1f1b", 2, 1, 1, 0), (4, 4, "1f1b", 8, 1, 1, 0),
    (4, 4, "interleaved", 4, 2, 1, 0), (4, 4, "interleaved", 8, 2, 1, 0),
    (4, 4, "zero-bubble", 3, 1, 1, 0), (4, 4, "zero-bubble", 8, 1, 1, 0),
    (4, 2, "1f1b", 4, 1, 1, 0), (4, 2, "interleaved", 4, 2, 1, 0), (4, 2, "1f1b", 4, 1, 1, 1),  # with dp 2
    (4, 2, "1f1b", 4, 1, 2, 0), (4, 2, "zero-bubble", 4, 1, 2, 0), (4, 2, "interleaved", 2, 2, 2, 0),  # tp 2
]


def _label(world, pp, name, m, v, tp, zero):
    dp = world // (pp * tp)
    return (f"pp {pp} {name}{f' v={v}' if v > 1 else ''} m={m}" + (f" x dp {dp}" if dp > 1 else "")
            + (f" x tp {tp}" if tp > 1 else "") + (f" zero {zero}" if zero else ""))


@pytest.mark.equivalence
@pytest.mark.parametrize("world,pp,name,m,v,tp,zero", RUNS, ids=[_label(*r).replace(" ", "-") for r in RUNS])
def test_matches_the_single_process_run(world, pp, name, m, v, tp, zero):
    cfg = validate(config(world, pp, name, m, v, tp, zero), world)
    ref = reference(cfg.global_batch)
    per_rank = train_parallel(cfg, world)
    for rank, got in enumerate(per_rank):
        assert_matches(compare(_label(world, pp, name, m, v, tp, zero), ref, got, record=rank == 0))


def test_split_with_fewer_blocks_on_the_first_and_last_stages():
    from ultrascale.parallel.pipeline.partition import split

    assert split(8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert split(10, 4) == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))  # the first stages take the remainder
    assert split(4, 2, first=1) == ((0,), (1, 2, 3))
    # Llama 3 405B as Meta ran it: 126 blocks on 16 stages, one fewer on the first and the last.
    sizes = [len(s) for s in split(126, 16, first=7, last=7)]
    assert sizes == [7] + [8] * 14 + [7]
    assert [len(s) for s in split(8, 2, 2, first=1, last=1)] == [1, 3, 3, 1]  # virtual stages
    # The engine cuts its model with the same rule.
    import torch

    from ultrascale.model.transformer import Transformer
    from ultrascale.parallel.pipeline.stage import keep_stages

    with torch.device("meta"):
        kept = [list(keep_stages(Transformer(get_preset("tiny", layers=4)), r, 2, 1, first=1).layers.keys())
                for r in (0, 1)]
    assert kept == [["0"], ["1", "2", "3"]]


@pytest.mark.equivalence
def test_fewer_blocks_on_the_first_stage_matches_the_single_process_run():
    from ultrascale.testing.compare import check_against_single

    p = ParallelConfig(pp=2, pp_first_stage_layers=1)
    t = TrainConfig(steps=2, seq_len=16, micro_batch=1, grad_accum=2, seed=11, progress=False)
    cfg = validate(RunConfig(model=get_preset("tiny", layers=4), parallel=p, train=t), 2)
    check_against_single("pp 2 first stage 1 of 4 layers", cfg, 2)


# -- errors and pictures ---------------------------------------------------------------
@pytest.mark.parametrize("parallel,layers,grad_accum,message", [
    (ParallelConfig(pp=3), 2, 3, "stages but the model has 2 layers"),
    (ParallelConfig(pp=2, pp_schedule="interleaved", pp_chunks=2), 3, 2, "stages but the model has 3 layers"),
    (ParallelConfig(pp=2, pp_schedule="interleaved", pp_chunks=2), 8, 3, "groups of pp = 2"),
    (ParallelConfig(pp=2, pp_chunks=2), 8, 2, "needs --pp-schedule interleaved"),
    (ParallelConfig(pp=2, pp_schedule="gpipe"), 8, 2, "--pp-schedule must be one of"),
    (ParallelConfig(dp=2, pp=2, zero=2), 8, 2, "composes with --zero 1"),
    (ParallelConfig(pp=2, pp_first_stage_layers=4), 4, 2, "at least one block"),
    (ParallelConfig(pp=1, pp_last_stage_layers=1), 4, 2, "need --pp > 1"),
    (ParallelConfig(pp=2, pp_first_stage_layers=-1), 4, 2, "must be 0"),
])
def test_layouts_that_cannot_work(parallel, layers, grad_accum, message):
    world = (parallel.dp or 1) * parallel.pp
    cfg = RunConfig(model=get_preset("tiny", layers=layers), parallel=parallel,
                    train=TrainConfig(grad_accum=grad_accum))
    from ultrascale.train.startup import check_run  # a layout is refused where the run starts

    with pytest.raises(ConfigError, match=message):
        check_run(cfg, world)



def test_pp_schedule_prints_the_bubble_and_draws_it(tmp_path):
    out = tmp_path / "s.png"
    r = ultrascale("pp-schedule", "--schedule", "interleaved", "--pp", "4", "--micro-batches", "8", "--chunks", "2",
                   "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "bubble ratio 0.1875" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_recorded_run_draws_like_a_simulated_one(tmp_path):
    trace, png = tmp_path / "trace.json", tmp_path / "t.png"
    r = ultrascale("train", "--model", "tiny", "--layers", "4", "--nproc", "2", "--pp", "2", "--pp-schedule",
                   "1f1b", "--micro-batch", "1", "--grad-accum", "4", "--steps", "2", "--seq-len", "16",
                   "--pp-trace", str(trace), "--no-progress")
    assert r.returncode == 0, r.stderr
    data = json.loads(trace.read_text())
    kinds = [[x["kind"] for x in rank if x["kind"] in "FB"] for rank in data["ranks"]]
    assert kinds == [[a.kind for a in acts] for acts in build("1f1b", 2, 4)]  # executed exactly as scheduled
    r = ultrascale("pp-schedule", "--trace", str(trace), "--out", str(png))
    assert r.returncode == 0 and "measured bubble ratio" in r.stdout and png.exists()
