"""ultrascale: the Ultra-Scale Playbook as software that runs.

- `ultrascale.model`: a Llama-style decoder that knows nothing of parallelism;
- `ultrascale.distributed`: the named grid (ParallelContext), the launcher, the collectives;
- `ultrascale.parallel`: one module per technique, each a transform of the model or its gradients;
- `ultrascale.train`: data, trainer, precision, recomputation, checkpoints, metrics.
"""

__version__ = "0.1.0"
