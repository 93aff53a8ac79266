"""The README's tour, every command of it, in a shell as a user pastes it, shortened to a few steps.

What is shortened, and only that: a run's --steps (at most 3; a resumed run 2 more than the run it
resumes), and a transformers Llama is written where the tour says `path/to/llama`. A command the
README adds is run here without anyone listing it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from ultrascale.testing.cli import forked

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def tour_commands() -> list[str]:
    text = open(README).read()
    block = text[text.index("## A tour"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    lines, joined = [], ""
    for line in block.splitlines():
        joined += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        if joined.strip() and not joined.lstrip().startswith("#"):
            lines.append(joined.strip())
        joined = ""
    return lines


def shorten(command: str) -> str:
    """--steps N -> 3 for a run, 5 for a resumed one (its checkpoint holds 3); a run without --steps gets 3."""
    command = command.split("   #")[0].split("  # ")[0]
    if not re.match(r"ultrascale train\b", command):
        return command
    steps = "5" if "--resume" in command else "3"
    if "--steps" in command:
        return re.sub(r"--steps \d+", f"--steps {steps}", command)
    return command + f" --steps {steps}"


def test_the_tour_is_read_whole():
    commands = tour_commands()
    assert len(commands) > 30 and all(c.startswith("ultrascale ") for c in commands), commands
    assert any("--init-from hf:path/to/llama" in c for c in commands)
    # the file a command reads comes from one above it
    emit = next(i for i, c in enumerate(commands) if "--emit-config run.toml" in c)
    assert emit < next(i for i, c in enumerate(commands) if "--config run.toml" in c)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tour")
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(str(root / "path" / "to" / "llama"))
    return root


# Each command runs in a process of its own with the argv a shell makes of the line, forked from a
# server that imported torch once (ultrascale.testing.cli.forked): a new interpreter per line would
# spend most of a tiny run importing torch and test nothing more. A line that needs a shell ($(...))
# goes through bash.
def _needs_a_shell(command: str) -> bool:
    return "$(" in command


# The flags whose value is a file or directory a command writes, and `data prepare SRC OUT`'s OUT.
WRITES = ("--save", "--log-jsonl", "--out", "-o", "--profile", "--emit-config", "--hf", "--tensorboard")


def _written(command: str) -> set[str]:
    words = shlex.split(command.split("   #")[0].split("  # ")[0])
    out = {words[i + 1] for i, w in enumerate(words[:-1]) if w in WRITES}
    if words[1:3] == ["data", "prepare"]:
        out.add([w for w in words[3:] if not w.startswith("-")][1])
    return out


def _reads(command: str, path: str) -> bool:
    return path in shlex.split(command.split("   #")[0].split("  # ")[0])[1:]


PARTS = 4  # the tour is run as this many tests, which pytest-xdist spreads over its workers


def tour_parts(commands: list[str], parts: int = PARTS) -> list[list[str]]:
    """The commands in `parts` lists, each in the tour's order: a command stays with every earlier one
    whose output it reads (--resume ck after --save ck, export after its checkpoint, plot after the
    logs), the chains so formed dealt out greedily, most commands first, to the part with fewest."""
    chain = list(range(len(commands)))  # union-find over the commands' indices

    def root(i):
        while chain[i] != i:
            chain[i] = chain[chain[i]]
            i = chain[i]
        return i

    for j, later in enumerate(commands):
        for i in range(j):
            if any(_reads(later, path) for path in _written(commands[i])):
                chain[root(j)] = root(i)
    chains: dict[int, list[int]] = {}
    for i in range(len(commands)):
        chains.setdefault(root(i), []).append(i)
    bins: list[list[int]] = [[] for _ in range(parts)]
    for members in sorted(chains.values(), key=len, reverse=True):
        min(bins, key=len).extend(members)
    return [[commands[i] for i in sorted(b)] for b in bins if b]


def test_the_parts_hold_every_command_once_after_what_it_reads():
    commands = [shorten(c) for c in tour_commands()]
    parts = tour_parts(commands)
    assert sorted(c for part in parts for c in part) == sorted(commands)
    for part in parts:  # what a command reads was written earlier in its own part
        for j, later in enumerate(commands):
            for i in range(j):
                if any(_reads(later, path) for path in _written(commands[i])):
                    assert (later in part) == (commands[i] in part), (commands[i], later)


# Each part its own xdist group (tests/conftest.py): the parts run on whichever worker is free.
@pytest.mark.parametrize("part", [pytest.param(i, marks=[pytest.mark.xdist_group(f"readme-tour-{i}"), pytest.mark.long])
                                  for i in range(PARTS)], ids=[f"part{i + 1}of{PARTS}" for i in range(PARTS)])
def test_every_command_of_the_tour_runs_as_pasted(workdir, part):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    commands = tour_parts([shorten(c) for c in tour_commands()])[part]
    here = workdir / f"part{part}"
    here.mkdir()
    os.symlink(workdir / "path", here / "path")
    for command in commands:
        if _needs_a_shell(command):
            r = subprocess.run(["bash", "-c", command], cwd=here, env=env, capture_output=True, text=True,
                               timeout=240)
        else:
            argv = shlex.split(command.split("   #")[0].split("  # ")[0])
            r = forked(["-m", "ultrascale", *argv[1:]], cwd=str(here), env=env, timeout=240)
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    # what the commands wrote, as the tour says
    for command in commands:
        for name in _written(command):
            assert (here / name).exists(), (command, name)
