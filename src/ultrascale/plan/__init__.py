"""The planner: the playbook's "finding the best training configuration" as a tool.

shape.py        the model as the planner sees it (ModelConfig + MoE fields), per-rank parameter lists
precision.py    bytes per parameter of each precision recipe
layout.py       one configuration (dp, tp, sp, pp + schedule, cp, ep, ZeRO, recompute, batch) and its rules
states.py       parameters, gradients, optimizer state per rank (ZeRO), the engine's buckets replayed
activations.py  what autograd keeps, per tensor of our block, and what TP / SP / CP divide
bubble.py       pipeline schedules: bubble and in-flight micro-batches (closed forms = the engine's simulator)
memory.py       every term per GPU, for every pipeline stage
hardware.py     GPUs and links (editable)
calibration.py  frameworks: implementation facts and the few named calibration constants
time.py         step time: compute, collectives, overlap, bubble
search.py       enumerate, drop what does not fit, rank by throughput
validate.py     the figures against the playbook's published H100 runs
report.py, chart.py, cli.py   what `ultrascale plan` prints and draws

docs/planner.md derives every formula and reports the validation figures.
"""
