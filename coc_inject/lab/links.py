"""How long a collective takes on an interconnect: nccl-tests' bus-bandwidth model (its
PERFORMANCE.md): for N ranks and S the bytes of the full buffer, time = S x factor / busbw + steps x
latency, factor (N-1)/N for all-gather, reduce-scatter and all-to-all, 2(N-1)/N for all-reduce, 1
for a point-to-point send. Presets are *achieved* bus bandwidths, cited in :data:`PRESETS`."""

from __future__ import annotations

from dataclasses import dataclass, replace

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "broadcast")


@dataclass(frozen=True)
class Link:
    name: str
    busbw_gbps: float  # achieved bus bandwidth, GB/s (1e9 bytes)
    latency_us: float  # per ring step
    source: str
    device_share: float = 1.0  # CUDA: share of the bytes also moved through device memory (the load a transfer puts there)

    def factor(self, kind: str, ranks: int) -> float:
        if kind not in KINDS:
            raise ValueError(f"collective kind {kind!r}: one of {', '.join(KINDS)}")
        if kind == "p2p":
            return 1.0
        if kind == "all_reduce":
            return 2.0 * (ranks - 1) / ranks
        return (ranks - 1) / ranks

    def steps(self, kind: str, ranks: int) -> int:
        return 1 if kind == "p2p" else (2 * (ranks - 1) if kind == "all_reduce" else ranks - 1)

    def seconds(self, kind: str, nbytes: int, ranks: int) -> float:
        """The collective's time on this link (0 for a zero-time link: the compute-only twin)."""
        if self.busbw_gbps == float("inf") or ranks < 2:
            return 0.0
        return nbytes * self.factor(kind, ranks) / (self.busbw_gbps * 1e9) + self.steps(kind, ranks) * self.latency_us * 1e-6

    def zero(self) -> "Link":
        """The same link taking no time and loading no device memory: what the compute-only twin runs over."""
        return replace(self, name=f"{self.name} (zero time)", busbw_gbps=float("inf"), latency_us=0.0, device_share=0.0)


_ALAYA = "docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests (nccl-tests all_reduce_perf busbw at large sizes)"
_SATURN = "saturncloud.io/blog/crusoe-nccl-cluster-validation (expected all_reduce_perf busbw)"
PRESETS = {link.name: link for link in (
    Link("nvlink4", 400.0, 2.0, "8x H100/H200 SXM, NVLink 4 + NVSwitch: 460-480 GB/s [" + _ALAYA + "], 400-450 GB/s ["
         + _SATURN + "]; 400 taken (all-gather and reduce-scatter run without NVLS, below all-reduce's figure)"),
    Link("nvlink5", 800.0, 2.0, "GB200 NVL72 (NVLink 5), 2 nodes x 4 GPUs over MNNVL: 811 GB/s measured "
         "[www.lixueduan.com/posts/ai/13-gb200-mnnvl-nccl-test]"),
    Link("pcie", 40.0, 5.0, "8x H100 PCIe Gen5, no NVSwitch: 35-45 GB/s [" + _ALAYA + "]"),
    Link("ib-ndr", 45.0, 5.0, "one 400 Gb/s NDR rail a GPU (peak 50 GB/s), every hop between nodes: 40-50 GB/s "
         "for GPUs on IB NDR without NVLink [" + _SATURN + "]"),
    Link("ib-hdr", 22.0, 5.0, "one 200 Gb/s HDR rail a GPU: NDR's achieved share of its peak applied to HDR's "
         "25 GB/s (derived, no measured figure found)"),
    Link("hccs-910b", 100.0, 3.0, "8x Ascend 910B, HCCS full mesh (7 links of 56 GB/s, 392 GB/s aggregate "
         "[www.meemx.com/p/hccl-contest-log-overall]); achieved: EP 8 dispatch bottleneck 102 GB/s "
         "[github.com/sgl-project/sgl-kernel-npu README]; 100 taken"),
    Link("1gbit", 0.125, 50.0, "our CPU test bed's emulated link (tc tbf rate 1gbit between two network "
         "namespaces, BRIEF section 6: a 16 MiB all-reduce of 2 ranks in ~140 ms, i.e. ~0.12 GB/s bus bandwidth)"),
)}


def preset(name: str) -> Link:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: one of {', '.join(PRESETS)}")
    return PRESETS[name]
