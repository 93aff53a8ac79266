"""The hardware table: GPUs and the links between them. Edit it to plan for another cluster.

Values are vendor data sheets (dense, no sparsity) and what NCCL reaches on
them; every time formula reads them from here:
- memory_bytes: what the driver lets the allocator have (torch's total_memory),
  a little under the marketing size;
- peak_flops by compute dtype ("fp32" means TF32 tensor cores, as the engine's
  MFU counts it, train/metrics.py);
- links: bandwidth is the per-GPU unidirectional bandwidth a ring collective
  achieves (NCCL "bus bandwidth"), latency the per-step cost alpha of a ring.
  NVLink joins the GPUs of a node; InfiniBand (one NIC per GPU) joins nodes.
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
    peak_flops: dict  # {"bf16": FLOP/s, "fp32": FLOP/s}
    hbm_bandwidth: float  # bytes/s
    intra: Link  # inside a node
    inter: Link  # between nodes
    node_size: int = 8

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter if crosses_nodes else self.intra


NVLINK4 = Link("NVLink 4 (NVSwitch)", 360e9, 5e-6)  # 450 GB/s per direction; ~360 GB/s bus bandwidth in NCCL
NVLINK3 = Link("NVLink 3 (NVSwitch)", 230e9, 5e-6)  # 300 GB/s per direction
IB_NDR = Link("InfiniBand NDR 400 Gb/s per GPU", 40e9, 10e-6)  # 50 GB/s line rate
IB_HDR = Link("InfiniBand HDR 200 Gb/s per GPU", 20e9, 10e-6)  # 25 GB/s line rate

GPUS = {
    "h100-80gb": GPU("h100-80gb", 79.19 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12}, 3.35e12, NVLINK4, IB_NDR),
    "h200": GPU("h200", 139.8 * GIB, {"bf16": 989.5e12, "fp32": 494.7e12}, 4.8e12, NVLINK4, IB_NDR),
    "a100-80gb": GPU("a100-80gb", 79.15 * GIB, {"bf16": 312e12, "fp32": 156e12}, 2.04e12, NVLINK3, IB_HDR),
    "a100-40gb": GPU("a100-40gb", 39.39 * GIB, {"bf16": 312e12, "fp32": 156e12}, 1.56e12, NVLINK3, IB_HDR),
}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]
