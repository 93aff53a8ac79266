"""The README's tour, every command of it, in a shell as a user pastes it, shortened to a few steps.

What is shortened, and only that: a run's --steps (at most 3; a resumed run 2 more than the run it
resumes), and a transformers Llama is written where the tour says `path/to/llama`. A command the
README adds is run here without anyone listing it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("index", range(len(tour_commands())))
def test_every_command_of_the_tour_runs_as_pasted(index, workdir):
    command = shorten(tour_commands()[index])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    r = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
