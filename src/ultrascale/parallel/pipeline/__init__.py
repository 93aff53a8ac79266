"""Pipeline parallelism: layers split into stages, micro-batches scheduled to shrink the bubble.

schedules.py  naive, AFAB, 1F1B, interleaved 1F1B, zero-bubble (ZB-H1), DualPipeV as per-rank action lists
simulate.py   timeline, bubble ratio and in-flight activations of any action lists
stage.py      the split of the model into (virtual) stages; deferred weight gradients
runtime.py    executes one rank's action list with point-to-point sends and receives
draw.py       the Gantt chart of a simulated or recorded schedule
"""

from ultrascale.parallel.pipeline.schedules import SCHEDULES, Action, schedule
from ultrascale.parallel.pipeline.simulate import Timeline, simulate

__all__ = ["SCHEDULES", "Action", "Timeline", "schedule", "simulate"]
