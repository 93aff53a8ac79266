"""The run's configuration and step metrics for TensorBoard and Weights & Biases.

Both get the same scalars (trainer.tensorboard_scalars: train/*, memory/*, moe/*, val/loss) at
each step, from the logging rank alone, and the run's configuration (RunConfig.to_dict()) once:

- TensorBoard (`--tensorboard DIR`): as hparams of the run, in the run's own event files, so
  that TensorBoard's HPARAMS tab lists every run of a parent directory with its settings
  (flattened: `train.lr`, `parallel.dp`, `model.hidden`, ...) beside its last training and
  validation loss. A run's full settings are also the rows of its table view.
- Weights & Biases (`--wandb PROJECT`, the `wandb` extra): `wandb.init(project=PROJECT,
  config=...)`, then `log(scalars, step=step)`. WANDB_MODE (offline, disabled), WANDB_DIR,
  WANDB_ENTITY and the rest of wandb's own environment apply. wandb's console lines are
  silenced (WANDB_SILENT or WANDB_QUIET, when set, decide instead) and it does not capture the
  run's stdout: the run prints one line of its own naming the W&B run (its page, or the
  offline directory and the command that uploads it). A run W&B does not start (online
  without an API key) is one line and exit status 2, before step 1.
"""

from __future__ import annotations

import importlib.util
import os

from ultrascale.errors import ConfigError


# -- TensorBoard ----------------------------------------------------------------------
def flat_config(config: dict, prefix: str = "") -> dict:
    """{"train.lr": 0.003, ...}: nested sections joined by dots; booleans as "true"/"false"
    (TensorBoard's hparams take numbers and strings; a boolean would show as 0 or 1)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        elif isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            out[name] = value
        elif value is not None:
            out[name] = str(value)
    return out


def write_hparams(writer, config: dict, metrics: list[str]) -> None:
    """The configuration as hparams of the run `writer` writes (not of a run of its own, as
    SummaryWriter.add_hparams would make), with `metrics` the scalar tags the HPARAMS tab shows
    beside them."""
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(flat_config(config), {tag: None for tag in metrics})
    for summary in (experiment, start, end):
        writer.file_writer.add_summary(summary)
    writer.flush()


# -- Weights & Biases ------------------------------------------------------------------
def check_wandb() -> None:
    """--wandb needs the package: refused before the run otherwise."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb needs the wandb package: pip install 'ultrascale[wandb]'")


class WandbRun:
    """One W&B run of the logging rank: the configuration at the start, the scalars at each step."""

    def __init__(self, project: str, config: dict):
        import wandb

        settings = {"console": "off"}  # the run's stdout stays the run's: no capture, no redirect
        if "WANDB_SILENT" not in os.environ and "WANDB_QUIET" not in os.environ:
            settings["silent"] = True
            # Before init: wandb's setup already warns (on stderr) of a WANDB_DIR not made yet.
            wandb.setup(settings=wandb.Settings(silent=True))
        try:
            self.run = wandb.init(project=project, config=config, job_type="train",
                                  settings=wandb.Settings(**settings))
        except Exception as e:  # noqa: BLE001 - no credentials, no network, a refused project: one line, before step 1
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"--wandb {project}: W&B did not start the run ({first}): log in with `wandb login` "
                              f"(or set WANDB_API_KEY), or log locally with WANDB_MODE=offline") from None

    def describe(self) -> str:
        """A line naming the run: where to see it, or where it waits to be uploaded."""
        run = self.run
        mode = getattr(run.settings, "mode", "online")
        if getattr(run, "disabled", False) or mode == "disabled":
            return "W&B: disabled (WANDB_MODE=disabled): nothing is logged"
        if mode in ("offline", "dryrun"):
            where = run.settings.sync_dir
            return f"W&B: run {run.id} offline, in {where} (`wandb sync {where}` uploads it)"
        return f"W&B: run {run.name} at {run.url}"

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
