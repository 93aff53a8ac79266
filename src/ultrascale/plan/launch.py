"""plan -> a cluster: the commands that start an emitted run on its nodes.

One node: `ultrascale train --config FILE`, which starts the planned number of
processes itself (`nproc`). Several: torchrun on every node, each agent starting
a node's processes (`--nproc-per-node`, the cluster's node size) and meeting the
others at a rendezvous on the first node (c10d, torchrun's own store). Under
torchrun the engine takes its world from WORLD_SIZE, which equals the file's
`nproc`. Every node reads the same config, data and checkpoint paths: they must
lie on a filesystem all nodes share.

`--emit-launch slurm` writes that as an sbatch script: one task per node, each
running torchrun under srun, the rendezvous on the allocation's first host.
"""

from __future__ import annotations

import os
import shlex

from ultrascale.errors import ConfigError

RDZV_PORT = 29500  # torchrun's default master port


def nodes_of(world: int, node_size: int) -> tuple[int, int]:
    """(nodes, processes per node) for `world` processes on nodes of `node_size` GPUs."""
    if world <= node_size:
        return 1, world
    if world % node_size:
        raise ConfigError(f"--emit-launch: {world} processes do not fill nodes of {node_size} GPUs: "
                          f"plan a GPU count that is a multiple of {node_size}")
    return world // node_size, node_size


def torchrun_line(config: str, nodes: int, per_node: int, endpoint: str = f"$HEAD_NODE:{RDZV_PORT}",
                  run_id: str = "$RUN_ID") -> str:
    """The command every node runs, the same on each (torchrun's flags as its documentation names them;
    the c10d rendezvous numbers the nodes)."""
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint {endpoint} --rdzv-id {run_id} -m ultrascale train --config {shlex.quote(config)}")


def launch_lines(config: str, world: int, node_size: int) -> list[str]:
    """What the emitted file says of its launch, one line each."""
    nodes, per_node = nodes_of(world, node_size)
    if nodes == 1:
        return [f"run with: ultrascale train --config {config}" + (f"  ({world} processes)" if world > 1 else "")]
    return [f"run on {nodes} nodes of {per_node} GPUs, the config, data and --save on a filesystem all of them read;",
            "on every node (HEAD_NODE the first node's address, RUN_ID one name for all of them):",
            "  " + torchrun_line(config, nodes, per_node),
            "or under Slurm: ultrascale plan ... --emit-launch slurm writes the sbatch script"]


def sbatch_script(config: str, world: int, node_size: int, job: str) -> str:
    nodes, per_node = nodes_of(world, node_size)
    line = torchrun_line(config, nodes, per_node, endpoint=f"$HEAD_NODE:{RDZV_PORT}", run_id="$SLURM_JOB_ID")
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",  # one torchrun agent per node; it starts the node's processes
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        f"# {config}, its data and its --save lie on a filesystem every node reads, at the same path.",
        "set -euo pipefail",
        # Exported: srun hands the environment to every node's task.
        'export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun {line}",
        "",
    ])


def write_sbatch(config: str, world: int, node_size: int, job: str) -> str:
    """Write the script beside the config (run.toml -> run.sbatch); its path."""
    path = os.path.splitext(config)[0] + ".sbatch"
    try:
        with open(path, "w") as f:
            f.write(sbatch_script(config, world, node_size, job))
    except OSError as e:
        raise ConfigError(f"--emit-launch slurm: cannot write {path} ({e.strerror})") from None
    return path
