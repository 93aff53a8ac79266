"""The hardware table: GPUs, and the clusters they sit in. Edit it to plan for another machine, or
set any cluster's link bandwidths from the command line (--nvlink-gbs, --ib-gbs: with_bandwidths).

A GPU is the chip (vendor data sheets, dense, no sparsity); a cluster is where
the GPUs sit: how many per node, the links inside a node and between nodes,
and what its network costs at scale beyond bytes. Every time formula reads them
from here:
- memory_bytes: what the driver lets the allocator have (torch's total_memory),
  a little under the marketing size;
- peak_flops by compute dtype ("fp32" means TF32 tensor cores, as the engine's
  MFU counts it, train/metrics.py; "fp8" only where the chip has FP8 tensor cores);
- links: bandwidth is the per-GPU unidirectional bandwidth a ring collective
  achieves (NCCL "bus bandwidth"), latency the per-step cost alpha of a ring;
- host: what each GPU's share of its host offers ZeRO-Offload (parallel/offload.py):
  the PCIe link to host memory, the host memory bandwidth its CPU optimizer step
  is bound by, and the local NVMe drives' bandwidth;
- node_pair_sync_s: a cost per micro-batch per pair of nodes the job spans,
  measured on one cluster only (the playbook's: plan/time.py, "Synchronization").
  The generic clusters carry none: a term fitted on one network is not a fact
  about another.

Which software runs on it (kernels, overheads, how a pipeline receives) is the
framework's (calibration.py): the two are chosen apart (`--framework`, `--cluster`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per GPU, one direction, as a ring collective sees it
    latency: float  # seconds per ring step


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_flops: dict  # {"bf16": FLOP/s, "fp32": FLOP/s, "fp8": FLOP/s where the chip has FP8 tensor cores}
    hbm_bandwidth: float  # bytes/s

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


@dataclass(frozen=True)
class Host:
    """One GPU's share of its host, for offload: bytes/s per GPU, each direction."""

    name: str
    pcie_bandwidth: float  # host <-> device copies from pinned memory, per GPU
    memory_bandwidth: float  # host DRAM per GPU: the CPU AdamW step reads and writes ~28 bytes an element
    disk_bandwidth: float  # local NVMe per GPU (the slower of read and write)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    intra: Link  # inside a node
    inter: Link  # between nodes
    node_size: int = 8
    node_pair_sync_s: float = 0.0  # per micro-batch per pair of nodes (see the module's docstring)
    help: str = ""
    host: Host | None = None  # what offload moves over and steps on (None: the GPU's generic host)

    @property
    def offload_host(self) -> Host:
        return self.host or HOSTS.get(self.gpu.name, HOSTS["h100-80gb"])

    # The chip's figures, read through the cluster by the memory and time models.
    @property
    def memory_bytes(self) -> float:
        return self.gpu.memory_bytes

    @property
    def memory_gib(self) -> float:
        return self.gpu.memory_gib

    @property
    def peak_flops(self) -> dict:
        return self.gpu.peak_flops

    @property
    def hbm_bandwidth(self) -> float:
        return self.gpu.hbm_bandwidth

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter if crosses_nodes else self.intra


NVLINK4 = Link("NVLink 4 (NVSwitch)", 360e9, 5e-6)  # 450 GB/s per direction; ~360 GB/s bus bandwidth in NCCL
NVLINK3 = Link("NVLink 3 (NVSwitch)", 230e9, 5e-6)  # 300 GB/s per direction
# The H800's NVLink: 400 GB/s both directions, 200 per direction (the H100's 900 cut for export); DeepSeek
# measure 160 GB/s per GPU on it (DeepSeek-V3, arXiv 2412.19437, section 3.2.2), the same 0.8 of the line
# rate as NVLINK4's 360 of 450.
NVLINK_H800 = Link("NVLink (H800, 400 GB/s bidirectional)", 160e9, 5e-6)
IB_NDR = Link("InfiniBand NDR 400 Gb/s per GPU", 40e9, 10e-6)  # 50 GB/s line rate
IB_HDR = Link("InfiniBand HDR 200 Gb/s per GPU", 20e9, 10e-6)  # 25 GB/s line rate
ROCE_400 = Link("RoCE 400 Gb/s per GPU", 40e9, 10e-6)  # Meta's RDMA fabric (Llama 3 paper, section 3.3.1)
# Jean Zay's A100 partition (BLOOM's): 4 x 100 Gb/s Omni-Path per node of 8, 50 Gb/s per GPU.
OMNIPATH_4X100 = Link("Omni-Path 4 x 100 Gb/s per node of 8", 5e9, 10e-6)

# Hosts of the vendors' 8-GPU nodes, per GPU (a node's figure / 8). PCIe: what pinned host <-> device
# copies reach (Gen5 x16: 64 GB/s line rate, ~50 measured; Gen4 x16: 32, ~25). Memory: the data
# sheets' DRAM bandwidth (DGX H100: 2 x 8 channels of DDR5-4800, 614 GB/s; DGX A100: 2 x 8 channels
# of DDR4-3200, 410 GB/s), about 60% of it reached by a streaming AdamW. Disk: the node's NVMe
# drives (DGX H100: 8 x 3.84 TB U.2, ~3.5 GB/s write each; DGX A100: 4 x 3.84 TB, ~3 GB/s each).
HOSTS = {
    "h100-80gb": Host("DGX H100 host (PCIe Gen5, DDR5, NVMe)", 50e9, 0.6 * 614e9 / 8, 3.5e9),
    "h200": Host("DGX H200 host (PCIe Gen5, DDR5, NVMe)", 50e9, 0.6 * 614e9 / 8, 3.5e9),
    "h800": Host("HGX H800 host (PCIe Gen5, DDR5, NVMe)", 50e9, 0.6 * 614e9 / 8, 3.5e9),
    "h100-96gb-hbm2e": Host("Grand Teton host (PCIe Gen5, DDR5, NVMe)", 50e9, 0.6 * 614e9 / 8, 3.5e9),
    "a100-80gb": Host("DGX A100 host (PCIe Gen4, DDR4, NVMe)", 25e9, 0.6 * 410e9 / 8, 4 * 3e9 / 8),
    "a100-40gb": Host("DGX A100 host (PCIe Gen4, DDR4, NVMe)", 25e9, 0.6 * 410e9 / 8, 4 * 3e9 / 8),
    # One rank on a CPU: host and device are one memory, so a "transfer" is a copy at the
    # elementwise rate measured for cpu-core below. The disk figure is an assumption, not a
    # measurement: a virtio disk's sequential rate (a small run's states stay in the page cache).
    "cpu-core": Host("the same memory (a CPU rank)", 8.93e9, 8.93e9, 1.0e9),
}

GPUS = {
    "h100-80gb": GPU("h100-80gb", 79.19 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12, "fp8": 1979e12}, 3.35e12),
    "h200": GPU("h200", 139.8 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12, "fp8": 1979e12}, 4.8e12),
    # H800 SXM: the H100 SXM's chip, memory and tensor-core peaks; only its NVLink differs (NVLINK_H800).
    "h800": GPU("h800", 79.19 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12, "fp8": 1979e12}, 3.35e12),
    "a100-80gb": GPU("a100-80gb", 79.15 * GIB, {"bf16": 312e12, "fp32": 156e12}, 2.04e12),
    "a100-40gb": GPU("a100-40gb", 39.39 * GIB, {"bf16": 312e12, "fp32": 156e12}, 1.56e12),
    # Meta's Grand Teton H100: 96 GB of HBM2e at 2.4 TB/s, run at 500 W (torchtitan's docs/performance.md).
    # Its dense peak is not published ("between SXM and NVL"); the SXM figure is what torchtitan divides by.
    "h100-96gb-hbm2e": GPU("h100-96gb-hbm2e", 93.6 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12, "fp8": 1979e12},
                           2.4e12),
    # One rank of this engine on a CPU: one process, one thread, one core. Measured on a 2-core AMD
    # EPYC with both ranks busy (benchmarks/bench_plan_cpu.py, plan/data/cpu_runs.json): the fp32
    # matmul ceiling, and the rate of one elementwise pass (what the memory-bound terms pay).
    "cpu-core": GPU("cpu-core", 12 * GIB, {"bf16": 101.7e9, "fp32": 101.7e9}, 8.93e9),
}

# gloo between processes of one machine (loopback TCP), fitted on its all-reduce times (same file).
GLOO_LOOPBACK = Link("gloo over loopback TCP", 1.27e9, 250e-6)


def _dgx(gpu: str, intra: Link, inter: Link) -> Cluster:
    return Cluster(gpu, GPUS[gpu], intra, inter,
                   help=f"8 x {gpu} per node, {intra.name}, {inter.name} (no cost fitted on one cluster)")


CLUSTERS = {
    # Generic nodes of 8 as the vendor builds them (DGX / HGX, one NIC per GPU): what --gpu picks.
    "h100-80gb": _dgx("h100-80gb", NVLINK4, IB_NDR),
    "h200": _dgx("h200", NVLINK4, IB_NDR),
    "h800": _dgx("h800", NVLINK_H800, IB_NDR),
    "a100-80gb": _dgx("a100-80gb", NVLINK3, IB_HDR),
    "a100-40gb": _dgx("a100-40gb", NVLINK3, IB_HDR),
    # The playbook's H100 cluster, whose runs the time model is validated on: its links are the
    # DGX H100's, and its jobs paid a cost per micro-batch growing with the square of the nodes
    # (0.7-1.6 s per micro-batch at 64 nodes whatever the model), fitted there (docs/planner.md).
    "playbook": Cluster("playbook", GPUS["h100-80gb"], NVLINK4, IB_NDR, node_pair_sync_s=2e-4,
                        help="the playbook's H100 cluster: its per-node-pair cost, fitted on its runs"),
    "grand-teton": Cluster("grand-teton", GPUS["h100-96gb-hbm2e"], NVLINK4, ROCE_400,
                           help="Meta's Grand Teton with H100 96GB HBM2e at 500 W, RoCE 400 Gb/s per GPU "
                                "(torchtitan's published runs)"),
    "llama3": Cluster("llama3", GPUS["h100-80gb"], NVLINK4, ROCE_400,
                      help="Llama 3's training cluster: Grand Teton with H100 80GB at 700 W, RoCE 400 Gb/s per GPU"),
    # DeepSeek-V3's: 2,048 H800 in nodes of 8 on NVLink/NVSwitch, InfiniBand between nodes (section 3.1), at
    # 50 GB/s per GPU (400 Gb/s, section 3.2.2): the generic H800 nodes, named for the run.
    "deepseek": Cluster("deepseek", GPUS["h800"], NVLINK_H800, IB_NDR,
                        help="DeepSeek-V3's H800 cluster: 8 per node, NVLink 160 GB/s, InfiniBand 400 Gb/s per GPU "
                             "(arXiv 2412.19437, sections 3.1, 3.2.2)"),
    "jean-zay": Cluster("jean-zay", GPUS["a100-80gb"], NVLINK3, OMNIPATH_4X100,
                        help="Jean Zay's A100 partition: 8 A100 80GB per node, 4 x 100 Gb/s Omni-Path "
                             "(BLOOM-176B's)"),
    # This engine's own runs on a CPU: the cluster its `ultrascale` framework constants were fitted on.
    "cpu": Cluster("cpu", GPUS["cpu-core"], GLOO_LOOPBACK, GLOO_LOOPBACK, node_size=2,
                   help="a 2-core CPU, one rank per core, gloo (measured: benchmarks/bench_plan_cpu.py)"),
}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]


def playbook_cluster(gpu: str = "h100-80gb") -> Cluster:
    """The playbook's cluster with another GPU in its nodes (the course asks what an H200 would change)."""
    from dataclasses import replace

    return replace(CLUSTERS["playbook"], gpu=get_gpu(gpu))


def get_cluster(name: str | None = None, gpu: str | None = None) -> Cluster:
    """A cluster by name; or, with only a GPU named, the generic nodes of that GPU (h100-80gb if neither)."""
    if name is None:
        name = gpu or "h100-80gb"
        if name not in CLUSTERS:
            get_gpu(name)  # the GPU exists but no generic cluster of it does
            raise ConfigError(f"no generic cluster of {name}: name one with --cluster ({', '.join(CLUSTERS)})")
    if name not in CLUSTERS:
        raise ConfigError(f"unknown cluster {name!r}: choose one of {', '.join(CLUSTERS)}")
    cluster = CLUSTERS[name]
    if gpu is not None and gpu != cluster.gpu.name:
        raise ConfigError(f"--gpu {gpu} but cluster {name} has {cluster.gpu.name}: drop --gpu, or pick the cluster "
                          f"of that GPU")
    return cluster


def with_bandwidths(cluster: Cluster, nvlink_gbs: float | None = None, ib_gbs: float | None = None) -> Cluster:
    """The cluster with its links' bandwidths set (GB/s per GPU and direction, as a collective
    achieves them: NCCL's bus bandwidth), for a machine the table does not hold (--nvlink-gbs, --ib-gbs)."""
    import math
    from dataclasses import replace

    said = []
    for flag, value, field in (("--nvlink-gbs", nvlink_gbs, "intra"), ("--ib-gbs", ib_gbs, "inter")):
        if value is None:
            continue
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number of GB/s per GPU and direction (e.g. 160 for the "
                              f"H800's NVLink, 40 for 400 Gb/s InfiniBand), got {value}")
        link = getattr(cluster, field)
        cluster = replace(cluster, **{field: Link(f"{link.name} at {value:g} GB/s", value * 1e9, link.latency)})
        said.append(f"{flag} {value:g}")
    if said:
        cluster = replace(cluster, help=f"{cluster.help}; {', '.join(said)}")
    return cluster
