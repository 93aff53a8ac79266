"""What a newcomer finds without reading the source: the presets and the defaults in `train --help`
and the README, every file the command line writes named when written, with ordinary permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ultrascale.cli import build_parser
from ultrascale.model.config import PRESETS, presets_table
from ultrascale.testing.cli import ultrascale

README = Path(__file__).parents[1] / "README.md"


def _train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["train"].format_help()


def test_the_presets_are_in_train_help_and_the_readme():
    text = _train_help()
    table = presets_table()
    for line in table.splitlines():
        assert line.split()[0] in text
    assert len(table.splitlines()) == len(PRESETS) + 1
    assert table in README.read_text(), "README's presets table is stale: paste model.config.presets_table()"


def test_train_help_shows_the_defaults():
    text = " ".join(_train_help().split())
    for shown in ("--steps STEPS optimizer steps", "(default: 20)", "--lr LR peak learning rate (default: 0.003)",
                  "--dtype DTYPE", "(default: fp32)", "(default: tiny)", "--dp-mode DP_MODE", "(default: bucket)"):
        assert shown in text, shown


def test_files_are_named_when_written_with_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        png, toml = tmp_path / "zb.png", tmp_path / "run.toml"
        r = ultrascale("pp-schedule", "--schedule", "zero-bubble", "--pp", "2", "--micro-batches", "4", "--out", str(png))
        assert r.returncode == 0 and f"wrote {png}" in r.stdout
        assert stat.S_IMODE(png.stat().st_mode) == 0o644  # as a plain open() makes it, not mkstemp's 0600
        r = ultrascale("plan", "--model", "tiny", "--gpus", "2", "--seq-len", "32", "--global-batch-tokens", "128",
                       "--emit-config", str(toml))
        assert r.returncode == 0 and f"wrote {toml}: set its data, then run it with ultrascale train --config {toml}" in r.stderr
        r = ultrascale("train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--micro-batch", "2",
                       "--no-progress", "--peak", "1", "--save", str(tmp_path / "ck"), "--log-jsonl",
                       str(tmp_path / "a.jsonl"))
        assert r.returncode == 0, r.stderr
        assert f"saved {tmp_path / 'ck'} at step 1" in r.stdout
        assert f"wrote {tmp_path / 'a.jsonl'}: one JSON line per step" in r.stdout
    finally:
        os.umask(old)


def _parsers(parser, prog="ultrascale"):
    import argparse

    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_no_help_text_stops_before_what_it_introduces():
    # A description cut at a paragraph break ends on the colon of the list it was about to give.
    from ultrascale.cli import build_parser

    for prog, p in _parsers(build_parser()):
        text = (p.description or "").rstrip()
        assert not text.endswith(":"), (prog, text[-200:])
