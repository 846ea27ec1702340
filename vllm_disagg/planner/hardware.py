"""GPU and link presets for the roofline model.

Numbers are vendor peaks (dense BF16 tensor FLOP/s, HBM bandwidth, one direction of a link); the planner applies
efficiency factors on top, so presets stay comparable with spec sheets.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class GPU:
    """One accelerator: what bounds prefill (FLOP/s), decode (memory bandwidth) and batch size (memory)."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float


@dataclass(frozen=True)
class Link:
    """The path KV takes from a prefill to a decode instance.

    ``setup_s`` is the fixed cost per transfer (launch, notification, completion) that does not shrink with size:
    it is what makes short prompts not worth moving.
    """

    name: str
    bytes_per_s: float
    setup_s: float = 0.0

    def wire_s(self, nbytes: float) -> float:
        """Seconds the bytes occupy the link: size over bandwidth, no setup."""
        return nbytes / self.bytes_per_s

    def transfer_s(self, nbytes: float) -> float:
        """Setup plus wire time: an un-overlapped transfer of ``nbytes``."""
        return self.setup_s + self.wire_s(nbytes)


# Per-transfer costs above the link's own setup, measured on this project's reference machine (2-core x86, loopback):
# the transfer engine's control round trips (the decode's registration, the layer notices, the completion) for a
# transfer whose prefill already finished, `python benchmarks/transport.py` ("fixed cost per transfer", TCP, 32
# layers); and the proxy's extra hop on a transfer plan, kept at a conservative 2 ms: `python benchmarks/proxy.py`
# measured 0.25 ms added TTFT for a colocated request at concurrency 1 and 7.9 ms p50 for transfer plans at
# concurrency 16 (queueing included). Replace both with a fleet's own figures (--transfer-fixed-ms, --proxy-hop-ms).
MEASURED_ENGINE_FIXED_S = 0.0012
MEASURED_PROXY_HOP_S = 0.0020

MIB = 1 << 20

# Memory is the total the card reports (nvidia-smi's MiB): vLLM's gpu_memory_utilization is a share of that, and a
# card sold as "80 GB" holds 80 GiB less what the driver keeps, not 80e9 bytes.
GPUS: dict[str, GPU] = {
    "a100-80g": GPU("A100-80G", 312e12, 2.04 * TB, 81920 * MIB),
    "h100-sxm": GPU("H100-SXM", 989e12, 3.35 * TB, 81559 * MIB),
    "h200": GPU("H200", 989e12, 4.8 * TB, 143771 * MIB),
}

# Setup costs: NVLink/PCIe copies are a CUDA memcpy launch (~0.1 ms); RDMA pays a descriptor post and a completion
# round trip per transfer (NIXL reported ~3 ms launch cost before optimisation; 1 ms is today's order); plain TCP adds
# a kernel round trip and a handshake on top (2 ms).
LINKS: dict[str, Link] = {
    # NVLink 4 (H100): 900 GB/s is the total of both directions over 18 links; a KV copy from prefill to decode
    # moves one way, 450 GB/s.
    "nvlink": Link("NVLink", 450 * GB, 0.0001),
    # PCIe Gen5 x16: 32 GT/s x 16 lanes x 128b/130b = 63 GB/s per direction.
    "pcie5": Link("PCIe-Gen5-x16", 63 * GB, 0.0001),
    "rdma-400g": Link("RDMA-400G", 50 * GB, 0.001),
    "100gbe": Link("100GbE", 12.5 * GB, 0.002),
}


def gpu_preset(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --peak-tflops/--mem-bw-tbs)"
        )
    return GPUS[key]


def link_preset(name: str) -> Link:
    key = name.lower()
    if key not in LINKS:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)} (or give --link-gbs)")
    return LINKS[key]


def custom_gpu(
    name: str = "custom",
    peak_tflops: float | None = None,
    mem_bw_tbs: float | None = None,
    mem_gb: float | None = None,
    base: GPU | None = None,
) -> GPU:
    """A GPU from explicit numbers, each defaulting to ``base``'s (so one field of a preset can be changed)."""
    if base is None:
        if peak_tflops is None or mem_bw_tbs is None or mem_gb is None:
            raise ValueError(
                "a custom GPU without a base preset needs peak TFLOP/s, memory TB/s and memory GB"
            )
        return GPU(name, peak_tflops * 1e12, mem_bw_tbs * TB, mem_gb * GB)
    return GPU(
        name=f"{base.name}*" if (peak_tflops, mem_bw_tbs, mem_gb) != (None, None, None) else base.name,
        peak_flops=peak_tflops * 1e12 if peak_tflops is not None else base.peak_flops,
        mem_bw=mem_bw_tbs * TB if mem_bw_tbs is not None else base.mem_bw,
        mem_bytes=mem_gb * GB if mem_gb is not None else base.mem_bytes,
    )


@dataclass(frozen=True)
class InstanceSpec:
    """One serving instance: ``tp`` GPUs running one engine, and how close it gets to the peaks.

    ``eff_compute`` ~0.5 is a typical prefill MFU for large GEMMs; ``eff_mem`` ~0.8 is the fraction of HBM
    bandwidth a decode step achieves; ``step_overhead_s`` is the per-iteration scheduling/launch cost;
    ``gpu_mem_util`` is the memory share the engine may use (vLLM's ``--gpu-memory-utilization``).
    """

    gpu: GPU
    tp: int = 1
    eff_compute: float = 0.5
    eff_mem: float = 0.8
    step_overhead_s: float = 0.001
    gpu_mem_util: float = 0.9

    def __post_init__(self) -> None:
        if self.tp < 1 or not (0 < self.eff_compute <= 1) or not (0 < self.eff_mem <= 1):
            raise ValueError("tp must be >= 1 and efficiencies in (0, 1]")

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of the whole instance."""
        return self.gpu.peak_flops * self.eff_compute * self.tp

    @property
    def bandwidth(self) -> float:
        """Achieved memory bytes/s of the whole instance."""
        return self.gpu.mem_bw * self.eff_mem * self.tp

    @property
    def usable_mem_bytes(self) -> float:
        return self.gpu.mem_bytes * self.gpu_mem_util * self.tp
