"""Pipeline parallelism: the schedules as data, the simulator's formulas, and the runtime
against the single-process run on real gloo processes."""

import functools
import json
from fractions import Fraction

import pytest

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import get_preset
from ultrascale.parallel.pipeline.partition import v_shaped
from ultrascale.parallel.pipeline.schedules import SCHEDULES, build, schedule
from ultrascale.parallel.pipeline.simulate import simulate
from ultrascale.testing.cli import ultrascale
from ultrascale.testing.compare import RunRecord, assert_matches, compare, train_parallel, train_single


# -- the schedules ---------------------------------------------------------------
def valid(name, p, m, v):
    if name == "dualpipev":
        return v == 2 and m >= 2 * p
    return not (name == "interleaved" and m % p) and (v == 1 or name == "interleaved")


GRID = [(name, p, m, v) for name in SCHEDULES for p in (1, 2, 3, 4) for m in range(1, 9)
        for v in ({"interleaved": (1, 2, 3), "dualpipev": (2,)}.get(name, (1,))) if valid(name, p, m, v)]


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
    simulate(schedule(name, p, m, v), p, v, vshape=v_shaped(name))  # raises if the ranks would deadlock


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


@pytest.mark.parametrize("p,m", [(2, 4), (2, 9), (3, 6), (4, 8), (4, 13), (8, 16)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1, 1, 1), (2, 2, 1), (1, 1, 0.5), (3, 2, 1), (1, 1, 0)])
def test_dualpipe_v_bubble_and_memory(p, m, t_f, t_b, t_w):
    # Costs are per chunk, half a stage of 1F1B on the same p ranks. While a chunk's input gradient
    # costs no more than its forward, the V's bubble is (p-1)(t_f + t_b - t_w) whatever m is: ZB-H1's
    # form with half-stage costs, so half ZB-H1's bubble on the same p ranks and a sixth of 1F1B's
    # at equal costs.
    tl = simulate(schedule("dualpipe", p, m), p, 2, t_f, t_b, t_w, vshape=True)
    assert tl.bubble_time == pytest.approx((p - 1) * (t_f + t_b - t_w))
    # Activations: 2p + 1 chunks' worth on every rank (DeepSeek's table: PP + 1 for its 2p stages),
    # against 1F1B's p - rank stages' worth (= 2(p - rank) chunks).
    assert tl.peak_in_flight == [2 * p + 1] * p
    if (t_f, t_b, t_w) == (1, 1, 1):
        one, zb = simulate(schedule("1f1b", p, m), p, t_f=2, t_b=2, t_w=2), simulate(schedule("zero-bubble", p, m), p,
                                                                                        t_f=2, t_b=2, t_w=2)
        assert (one.bubble_time, zb.bubble_time) == (6 * (p - 1), 2 * (p - 1 + max(0, p - m)))
        assert tl.bubble_time == one.bubble_time / 6 and tl.makespan - tl.bubble_time == one.makespan - one.bubble_time


def test_dualpipe_v_runs_down_and_back_up_the_ranks():
    from ultrascale.parallel.pipeline.partition import holds_head, rank_of_stage, virtual_stages

    assert [virtual_stages(r, 4, 2, vshape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of_stage(s, 4, vshape=True) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert holds_head(0, 4, vshape=True) and not holds_head(3, 4, vshape=True)
    # The turn from stage 3 to stage 4 is a hand-off inside rank 3: its message costs nothing.
    free, slow = (simulate(schedule("dualpipev", 4, 8), 4, 2, t_comm=c, vshape=True) for c in (0, 0.5))
    assert slow.makespan > free.makespan
    last_rank = [a for a in schedule("dualpipev", 4, 8)[3] if a.kind == "SEND_F" and a.chunk == 0]
    assert len(last_rank) == 8  # every micro-batch turns there


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
def config(world, pp, name, m, v=1, tp=1, zero=0, steps=2, pp_trace=""):
    p = ParallelConfig(dp=world // (pp * tp), pp=pp, tp=tp, pp_schedule=name, pp_chunks=v, zero=zero,
                       bucket_mb=0.05)
    t = TrainConfig(steps=steps, seq_len=16, micro_batch=1, grad_accum=m, seed=11, progress=False,
                    pp_trace=pp_trace)
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
    (2, 2, "dualpipev", 4, 2, 1, 0), (4, 4, "dualpipev", 8, 2, 1, 0), (4, 2, "dualpipev", 5, 2, 1, 0),  # DualPipeV
    (4, 2, "dualpipev", 4, 2, 2, 0),  # DualPipeV x tp 2
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


@pytest.mark.equivalence
def test_dualpipe_v_reducing_gradients_too_early_fails_the_check():
    # The rule that serves ZB-H1 (reduce after each chunk's last B-or-I and its last W) is wrong in the
    # V: there a full B of a chunk can come after a W of the same chunk, or the other way round.
    from ultrascale.testing.compare import FP32, compare_against_single

    cfg = config(4, 2, "dualpipe", 5, 2)
    c = compare_against_single(_label(4, 2, "dualpipev", 5, 2, 1, 0), cfg, 4,
                               fault="pp-sync-at-last-b-or-i-and-last-w")[0]
    assert c.failures(FP32), f"the check passed DualPipeV with gradients reduced too early: {c.line()}"


# -- the schedule's clock of a recorded step ------------------------------------------
CLOCKED = [  # (world, pp, schedule, m, v): every schedule on 4 stages, and one with dp 2 beside it
    (4, 4, "naive", 3, 1), (4, 4, "afab", 8, 1), (4, 4, "1f1b", 8, 1), (4, 4, "interleaved", 8, 2),
    (4, 4, "zero-bubble", 8, 1), (4, 4, "dualpipev", 8, 2), (4, 2, "1f1b", 5, 1),
]


def clocked_step(tmp_path, world, pp, name, m, v, fault=None):
    """The compute actions of a recorded step on the runtime's schedule clock, and the simulator's."""
    from ultrascale.parallel.pipeline import draw

    path = tmp_path / "trace.json"
    cfg = validate(config(world, pp, name, m, v, steps=1, pp_trace=str(path)), world)
    train_parallel(cfg, world, fault=fault)
    got = [[(a, s, e) for a, k, s, e in rank if k in "FBIW"]
           for rank in draw.trace_spans(draw.read_trace(path), clock=True)]
    tl = simulate(schedule(name, pp, m, v), pp, v, vshape=v_shaped(name))
    return got, [[(repr(a), s, e) for a, s, e in rank] for rank in tl.spans]


@pytest.mark.parametrize("world,pp,name,m,v", CLOCKED, ids=[f"pp{pp}-{n}-m{m}" + (f"-dp{w // pp}" if w > pp else "")
                                                           for w, pp, n, m, v in CLOCKED])
def test_a_recorded_step_on_the_schedules_clock_is_the_simulated_step(tmp_path, world, pp, name, m, v):
    # Each action at its unit cost, each message carrying its sender's clock: the runtime waits on
    # exactly what the simulator assumes, action for action (sums of 1s and 2s: exact in floats).
    got, simulated = clocked_step(tmp_path, world, pp, name, m, v)
    assert got == simulated


def test_every_kind_of_action_has_its_own_colour_and_label():
    from ultrascale.parallel.pipeline import draw

    assert len(set(draw.COLOURS.values())) == len(draw.COLOURS) and set(draw.LABELS) == set(draw.COLOURS)


def test_the_schedules_clock_shows_a_runtime_playing_another_schedule(tmp_path):
    # AFAB played where 1F1B was asked trains the same losses with the same bubble: only the
    # timeline shows that every forward ran before the first backward.
    got, simulated = clocked_step(tmp_path, 4, 4, "1f1b", 8, 1, fault="pp-1f1b-played-as-afab")
    assert got != simulated
    assert [a for a, _, _ in got[0]][:9] == [f"F{i}" for i in range(8)] + ["B0"], got[0]


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
    (ParallelConfig(pp=2, pp_schedule="dualpipe"), 8, 3, "at least 2 x pp = 4 micro-batches"),
    (ParallelConfig(pp=2, pp_schedule="dualpipev", pp_chunks=3), 8, 4, "each rank holds exactly two chunks"),
    (ParallelConfig(pp=4, pp_schedule="dualpipe"), 6, 8, "8 stages but the model has 6 layers"),
])
def test_layouts_that_cannot_work(parallel, layers, grad_accum, message):
    world = (parallel.dp or 1) * parallel.pp
    cfg = RunConfig(model=get_preset("tiny", layers=layers), parallel=parallel,
                    train=TrainConfig(grad_accum=grad_accum))
    from ultrascale.train.startup import check_run  # a layout is refused where the run starts

    with pytest.raises(ConfigError, match=message):
        check_run(cfg, world)



@pytest.mark.parametrize("args,bubble", [(("interleaved", "--chunks", "2"), "0.1875"), (("dualpipe",), "0.0625")])
def test_pp_schedule_prints_the_bubble_and_draws_it(tmp_path, args, bubble):
    out = tmp_path / "s.png"
    r = ultrascale("pp-schedule", "--schedule", *args, "--pp", "4", "--micro-batches", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"bubble ratio {bubble}" in r.stdout  # dualpipe: 3 idle chunk-units of 48 (8 micro-batches x 2 chunks x 3)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def pair_violations(events, actions) -> tuple[list[str], int]:
    """What a profiled step of one rank does against DualPipe's overlapped pairs: the `pp:` spans
    must be the rank's actions in order, and for every pair (F of one micro-batch, then B of another),
    the B's gradient receive posted before the F must be in flight (gloo:recv, from its post to its
    wait) across the whole forward, and the F's send across the whole backward. A check of order on
    one thread's clock, not of speed. Returns the violations and the number of messages checked."""
    from ultrascale.parallel.pipeline.schedules import Action, overlapped_pairs

    main = [e for e in events if e["name"].startswith("pp:")]
    tid = main[0]["tid"]
    spans = {e["name"][3:]: (e["ts"], e["ts"] + e["dur"]) for e in main}
    bad = []
    if [e["name"][3:] for e in sorted(main, key=lambda e: e["ts"])] != list(map(repr, actions)):
        bad.append("the pp: spans are not the schedule's actions in order")
    p2p = {name: [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name and e["tid"] == tid]
           for name in ("gloo:recv", "gloo:send")}

    def launched_in(name, action):  # the message launched inside this action's span
        s, e = spans[repr(action)]
        return [iv for iv in p2p[name] if s <= iv[0] <= e]

    checked = 0
    compute = [a for a in actions if a.kind in ("F", "B", "I", "W")]
    for f, b in overlapped_pairs(compute):
        fwd, bwd = compute[f], compute[b]
        post, send = Action("POST_B", bwd.micro, bwd.chunk), Action("SEND_F", fwd.micro, fwd.chunk)
        for name, action, across in (("gloo:recv", post, fwd), ("gloo:send", send, bwd)):
            if repr(action) in spans:
                for start, end in launched_in(name, action):
                    checked += 1
                    if end < spans[repr(across)][1]:
                        bad.append(f"{action!r}'s message ended before {across!r} did: not overlapped")
    return bad, checked


def test_a_recorded_dualpipe_step_runs_as_scheduled_with_its_pairs_overlapped(tmp_path):
    import gzip

    from ultrascale.train.trace_report import report

    trace, png, prof = tmp_path / "trace.json", tmp_path / "t.png", tmp_path / "prof"
    r = ultrascale("train", "--model", "tiny", "--layers", "4", "--nproc", "2", "--pp", "2", "--pp-schedule",
                   "dualpipe", "--micro-batch", "1", "--grad-accum", "4", "--steps", "2", "--seq-len", "16",
                   "--pp-trace", str(trace), "--profile", str(prof), "--profile-steps", "2:2", "--no-progress")
    assert r.returncode == 0, r.stderr
    data = json.loads(trace.read_text())
    kinds = [[x["kind"] for x in rank if x["kind"] in "FBIW"] for rank in data["ranks"]]
    assert kinds == [[a.kind for a in acts] for acts in build("dualpipev", 2, 4)]  # executed exactly as scheduled
    r = ultrascale("pp-schedule", "--trace", str(trace), "--out", str(png))
    assert r.returncode == 0 and "measured bubble ratio" in r.stdout and png.exists()
    assert "on the schedule's clock (each action its unit cost, each message its sender's clock): bubble ratio" \
        in r.stdout
    # The profiled step: the schedule with its posted receives, each pair's messages in flight
    # while the other pass computes, on both ranks (2 posted receives and 2 sends per rank here).
    actions = schedule("dualpipev", 2, 4)
    for rank in range(2):
        with gzip.open(prof / f"rank{rank}.trace.json.gz", "rt") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        assert sum(e["name"] == "step" for e in events) == 1
        bad, checked = pair_violations(events, actions[rank])
        assert not bad and checked >= 3, (rank, bad, checked)
        if rank == 0:
            # The check fails a runtime that waits for the posted receive at once (no overlap).
            posts = [e for e in events if e["name"].startswith("pp:POST_B")]
            late = [dict(e, dur=1.0) if e["name"] == "gloo:recv" and any(
                p["ts"] <= e["ts"] <= p["ts"] + p["dur"] for p in posts) else e for e in events]
            assert pair_violations(late, actions[rank])[0]
    # What `ultrascale trace` reads: the receive in flight across a forward is communication hidden
    # behind compute (1F1B's receives all block: nothing hidden). How much is the machine's (docs/benchmarks.md).
    assert all(rank["hidden_share"] > 0 for rank in report(str(prof)))
