"""What the LLM is asked: the series' requirements, the episodes so far, the transcript, the schema.

The requirements are those of the prompt the series was first written with
(title "Ultra-Scale Playbook: Part N", an Overview of bullets, markdown and
PyTorch code, exactly 2 hands-on exercises, a quiz of 3-4 questions with
answers at the end, file N_topic.ipynb), made precise where early notebooks went wrong:
solutions printed in the exercise cells, code that needs a GPU, DDP without a
process group. The titles and overviews of earlier episodes are included so
the new one can build on them without repeating them.
"""

from __future__ import annotations

import json

from ultrascale.series.schema import EPISODE_SCHEMA

SYSTEM = ("You are an expert ML engineer and educator writing interactive Jupyter notebooks for the "
          "Ultra-Scale Playbook video series, which teaches how to train LLMs efficiently on many GPUs. "
          "You answer with one JSON object and nothing else.")

REQUIREMENTS = """\
## Requirements

### Content
- Title: the notebook is "Ultra-Scale Playbook: Part {n}"; give the episode's topic as `title` (it is shown
  after "Part {n} - ") and a short snake_case `slug` (the file will be `{n}_<slug>.ipynb`).
- Overview: 2-6 bullets saying what the episode covers.
- Sections: a mix of markdown explanations and runnable PyTorch code; start simple, build up, use an
  analogy where it helps, connect every idea to real LLM training.
- Exactly 2 hands-on exercises. Each has:
  - `instructions` (markdown): what to write and why, without giving the code away;
  - `starter`: the code the learner completes - imports, signature and docstring given, the part to write
    replaced by a `# TODO` comment and `raise NotImplementedError`. Never put the answer here;
  - `solution`: the starter with the gap filled in (it is hidden from the learner);
  - `check`: Python statements that call the learner's code on small inputs and `assert` what must hold,
    every assert with a message that says what is wrong and how to fix it (e.g. "gradients are 4x too large:
    divide by the world size"). They run inside a function `check_exercise_<k>()`; they must fail on the
    starter and pass on the solution.
- Quiz: 3 or 4 multiple-choice questions, each with options, the 0-based index of the right one, and a
  one-line `why`. The notebook asks the questions in its Quiz section and gives all the answers (letter,
  option and why) together at the end, so never write an answer into a question's text, and put the right
  options at different letters (listed together, one letter for every answer gives them away).
- `references`: earlier episodes this one builds on, if any ("Building on what we learned in Part 1 ...").

### Code
- Use PyTorch where it applies; import everything you use (in the first code cell that needs it).
- Comment the non-obvious lines.
- Every cell must run top to bottom on a laptop CPU in well under a minute: no `.cuda()`, no "cuda"
  device, no NCCL outside a cell marked `needs_gpu: true` (such a cell is wrapped in
  `if torch.cuda.is_available():` and says it was skipped on a CPU).
- Several ranks are real processes, not lists of tensors: `from ultrascale.series.ranks import on_ranks`,
  then `on_ranks(2, fn, *args)` runs `fn` (a function defined in a cell) on 2 gloo processes with
  torch.distributed initialised (`dist.get_rank()`, `dist.all_reduce`, `dist.send`/`dist.recv` work) and
  returns each rank's result. A notebook that starts its own process group instead is run again as 2 ranks
  by the checks, and must give the same results there.
- Each exercise has 2-3 `hints`, from a nudge to nearly the answer; the solution can be revealed after them.
- Keep tensors small; use realistic numbers in explanations and calculations, computed by the code
  (never typed-in timings or measurements).
- Get the facts right:
  - data parallelism averages gradients (all-reduce sums, then divide by the number of ranks); never add
    per-parameter all-reduce hooks on top of DDP (it already reduces);
  - gradient accumulation averages too (divide each micro-batch loss by the number of micro-batches);
    under `no_sync()` gradients are reduced once, at the first backward outside the context;
  - MBS is the micro-batch size; GBS = MBS x GA x DP; 4M tokens of 4096-token sequences are 1024 samples;
  - mixed-precision training with Adam costs 2 (bf16 params) + 2 (bf16 grads) + 4 (fp32 master) + 4 + 4
    (Adam moments) = 16 bytes per parameter (20 with fp32 gradient accumulation), not 12;
  - ZeRO-1 shards the fp32 master weights and both Adam moments: k = 12 bytes per parameter divided by N,
    memory 2Ψ + 2Ψ + 12Ψ/N; ZeRO-2: 2Ψ + (2 + 12)Ψ/N; ZeRO-3: (2 + 2 + 12)Ψ/N;
  - ZeRO-1 and ZeRO-2 move as much data as DP (2Ψ: reduce-scatter + all-gather); ZeRO-3 moves 3Ψ
    (parameters all-gathered again for the backward);
  - a ring all-reduce sends 2(N-1)/N times the buffer per rank;
  - activation memory grows quadratically with the sequence length unless attention is fused
    (FlashAttention-style recomputation of the scores);
  - the pipeline bubble of AFAB and 1F1B is (p - 1) / m of the ideal time; 1F1B lowers the activations in
    flight, not the bubble.

### Episode
This is episode {n}."""

OUTPUT = """\
## Output
Return only one JSON object (no prose, no code fence) that follows this JSON schema:

```json
{schema}
```"""


def previous_block(previous) -> str:
    """The episodes so far (Episode objects), as the prompt shows them."""
    if not previous:
        return ""
    lines = ["## Earlier episodes (build on them, do not repeat them)"]
    for ep in previous:
        lines.append(f"- Part {ep.number}: {ep.title or ep.slug}")
        lines += [f"  - {b}" for b in ep.overview]
    return "\n".join(lines)


def build_prompt(n: int, transcript: str, previous=()) -> str:
    """The whole user message for episode `n`."""
    parts = [
        f"# Ultra-Scale Playbook notebook generation: Part {n}",
        "Create an educational notebook for the episode whose video transcript is below.",
        REQUIREMENTS.format(n=n),
        previous_block(previous),
        f"## Video transcript\n```\n{transcript.strip()}\n```",
        OUTPUT.format(schema=json.dumps(EPISODE_SCHEMA, indent=1)),
    ]
    return "\n\n".join(p for p in parts if p)


def repair_prompt(problems: list[str]) -> str:
    """The message that sends a rejected attempt back, with everything that was wrong."""
    listed = "\n".join(f"- {p}" for p in problems)
    return ("Your episode was not accepted. Fix every problem below and return the complete corrected episode "
            "as one JSON object with the same schema (no prose, no code fence):\n" + listed)
