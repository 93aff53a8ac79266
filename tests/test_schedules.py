"""Learning-rate schedules (train/optim.py) and per-step checkpoints (--keep-last).

The schedules are checked by their defining properties over a generated grid of settings, not
by a few values; --keep-last by what a user does with it: save every few steps, keep the newest
N, resume the directory (the latest), or any step of it, equal to a run never interrupted.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest

from ultrascale.config import LR_SCHEDULES, RunConfig, TrainConfig, validate
from ultrascale.train.optim import lr_at
from ultrascale.testing.cli import ultrascale as forked_ultrascale

GRID = list(itertools.product(LR_SCHEDULES, (0, 1, 5), (7, 40, 100), (0.0, 0.1), (0.1, 0.5)))


@pytest.mark.parametrize("schedule,warmup,steps,min_ratio,fraction", GRID)
def test_schedule_properties(schedule, warmup, steps, min_ratio, fraction):
    t = validate(RunConfig(train=TrainConfig(steps=steps, warmup_steps=warmup, lr=1.0, min_lr_ratio=min_ratio,
                                             lr_schedule=schedule, lr_decay_fraction=fraction)), 1).train
    assert t.lr_decay_steps == steps  # the decay follows --steps unless given
    lrs = [lr_at(k, t) for k in range(steps + 5)]
    for k in range(warmup):  # linear warmup to lr
        assert lrs[k] == pytest.approx((k + 1) / warmup)
    after = lrs[warmup:]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:]))  # never rises after warmup
    assert all(min_ratio - 1e-12 <= x <= 1.0 + 1e-12 for x in after)
    if schedule == "constant":
        assert all(x == 1.0 for x in after)
        return
    assert lrs[steps] == pytest.approx(min_ratio) and lrs[-1] == pytest.approx(min_ratio)  # the floor, and after
    span = steps - warmup
    if schedule == "wsd" and span > 1:
        stable_end = warmup + int((1 - fraction) * span)
        assert all(x == 1.0 for x in lrs[warmup:stable_end + 1])  # the stable phase holds lr
        if fraction * span > 1:
            assert lrs[steps - 1] < 1.0  # the decay takes steps of its own before the end
    if schedule in ("linear", "cosine") and span >= 4 and span % 2 == 0:
        # halfway through the decay: the midpoint between lr and the floor, for both curves
        assert lrs[warmup + span // 2] == pytest.approx((1 + min_ratio) / 2)
    if schedule == "cosine" and span >= 4:
        q = warmup + span // 4  # a quarter in, the cosine is still above the straight line
        assert lrs[q] > 1 - (1 - min_ratio) * (q - warmup) / span


def test_a_given_decay_length_is_kept_and_a_wrong_schedule_names_the_choices():
    from ultrascale.errors import ConfigError

    t = validate(RunConfig(train=TrainConfig(steps=10, lr_decay_steps=1000)), 1).train
    assert t.lr_decay_steps == 1000 and lr_at(9, t) > 0.99 * t.lr * 0.99
    with pytest.raises(ConfigError, match="cosine, linear, wsd, constant.*'wsd'"):
        validate(RunConfig(train=TrainConfig(lr_schedule="warmup-stable-decay")), 1)


def test_a_wrong_decay_is_seen_by_the_properties():
    """The property test above fails a schedule that never reaches its floor (the old fixed length)."""
    t = dataclasses.replace(TrainConfig(steps=20, warmup_steps=5, lr=1.0, min_lr_ratio=0.1), lr_decay_steps=1000)
    assert lr_at(20, t) != pytest.approx(0.1)


# ----------------------------------------------------------------------------- --keep-last


def ultrascale(*args):
    # a process of its own, forked from a server that imported torch once (testing/cli.py)
    return forked_ultrascale(*args, timeout=180)


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


RUN = ("train", "--steps", "6", "--seq-len", "32", "--micro-batch", "4", "--peak", "1", "--lr-decay-steps", "8")


def test_keep_last_keeps_the_newest_and_resumes_the_latest_or_any(tmp_path):
    whole = tmp_path / "whole.jsonl"
    assert ultrascale(*RUN[:2], "8", *RUN[3:], "--log-jsonl", str(whole)).returncode == 0
    r = ultrascale(*RUN, "--save", str(tmp_path / "ck"), "--save-every", "2", "--keep-last", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-000004", "step-000006"]
    assert f"saved {tmp_path / 'ck' / 'step-000002'} at step 2" in r.stdout
    # the directory: the latest (step 6)
    r = ultrascale("train", "--resume", str(tmp_path / "ck"), "--steps", "8", "--log-jsonl", str(tmp_path / "a.jsonl"))
    assert r.returncode == 0, r.stderr
    assert losses(tmp_path / "a.jsonl") == pytest.approx(losses(whole)[6:], rel=1e-6)
    # an older one, by its own directory (step 4)
    r = ultrascale("train", "--resume", str(tmp_path / "ck" / "step-000004"), "--steps", "8",
                   "--log-jsonl", str(tmp_path / "b.jsonl"))
    assert r.returncode == 0, r.stderr
    assert losses(tmp_path / "b.jsonl") == pytest.approx(losses(whole)[4:], rel=1e-6)
    # export and generate read the directory as its latest too
    assert ultrascale("export", "--hf", str(tmp_path / "hf"), str(tmp_path / "ck")).returncode == 0
    g = ultrascale("generate", str(tmp_path / "ck"), "--prompt", "x", "--max-new-tokens", "2")
    assert g.returncode == 0, g.stderr


def test_keep_last_without_save_is_one_line():
    r = ultrascale("train", "--steps", "1", "--keep-last", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--save" in r.stderr


def test_a_killed_per_step_save_is_cleaned_at_the_next_start(tmp_path):
    """A step-N.tmp that no later save of step N would replace (the run stopped there) goes at the next start."""
    ck = tmp_path / "ck"
    (ck / "step-000009.tmp").mkdir(parents=True)
    (ck / "step-000009.tmp" / "__0_0.distcp").write_bytes(b"half")
    r = ultrascale(*RUN[:2], "2", *RUN[3:], "--save", str(ck), "--keep-last", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(ck)) == ["step-000002"]
