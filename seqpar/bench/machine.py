"""Machine models for the replay (:mod:`.replay`): links, and how long a traced kernel takes.

A :class:`Machine` has ranks grouped in nodes; every rank has one port per direction into the
node's fabric (NVLink through NVSwitch, PCIe) and one per direction into the network (its NIC).
A message between two ranks of one node uses the fabric ports of both, across nodes their NICs;
ports are full duplex and the transfers on one port share its bandwidth fairly. Compute is either
the traced CPU time of each kernel (:data:`TRACED`, for replays of runs on this machine) or a
:class:`KernelModel` of a GPU.

Every number below says where it comes from. Link bandwidths are what NCCL reaches on large
messages per GPU and direction (the reasoning, per profile, is in
:data:`seqpar.schedulers.cluster.PROFILES`, which these profiles reuse).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from seqpar.schedulers.cluster import get_profile

# ----------------------------------------------------------------------------- kernel throughput
# FlashAttention throughput, TFLOP/s by sequence length (512, 1k, 2k, 4k, 8k, 16k), bf16, batch set so
# that batch x length = 16k tokens, hidden 2048, on one H100 80GB SXM5: Shah et al. 2024,
# "FlashAttention-3", arXiv 2407.08608, Figures 5 (forward, without and with causal mask) and 6
# (backward, without causal mask), the FlashAttention-2 and FlashAttention-3 bars. The backward
# with a causal mask is not published: we take the forward's causal / full ratio at each length.
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
_TABLES = {
    ("fa2", 128): {"fwd_none": (309, 350, 362, 368, 370, 370), "fwd_causal": (191, 260, 298, 319, 333, 335),
                   "bwd_none": (214, 260, 291, 310, 318, 322)},
    ("fa2", 64): {"fwd_none": (282, 306, 318, 321, 322, 324), "fwd_causal": (180, 229, 262, 284, 295, 299),
                  "bwd_none": (198, 238, 264, 279, 287, 291)},
    ("fa3", 128): {"fwd_none": (467, 565, 625, 638, 646, 648), "fwd_causal": (292, 423, 521, 579, 602, 616),
                   "bwd_none": (316, 424, 501, 542, 559, 561)},
    ("fa3", 64): {"fwd_none": (333, 392, 460, 476, 496, 497), "fwd_causal": (197, 265, 371, 420, 460, 473),
                  "bwd_none": (272, 363, 422, 453, 472, 474)},
}
# A100: FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s" of the A100's 312 TFLOP/s
# bf16 (Dao 2023, arXiv 2307.08691, abstract); its per-length bars are only published as images, so
# the A100 table is the H100 FlashAttention-2 table scaled to that top rate: 0.73 * 312 / 370.
A100_SCALE = 0.73 * 312 / 370
# Linear attention (chunked, chunk 64): flash-linear-attention's README benchmark of its Triton
# RetNet chunk kernels on one H100 80GB (batch 8, 32 heads, head dim 128, T = 16384): forward
# 1.749 ms, forward+backward 10.19 ms. By the bench's formula (seqpar.tracing.linear_flops) that is
# 4.12e11 FLOPs in 1.749 ms = 236 TFLOP/s forward and 8.25e11 in 8.44 ms = 98 TFLOP/s backward.
LINEAR_H100 = (236e12, 98e12)
# Dense bf16 peaks (NVIDIA datasheets): H100/H800 SXM 989 TFLOP/s, A100 312: the linear kernels keep
# the same fraction of the peak on an A100.
A100_PEAK_RATIO = 312 / 989
# HBM bandwidth (NVIDIA datasheets): H100/H800 SXM5 80GB 3.35 TB/s, A100 80GB SXM 2.039 TB/s, A100 80GB
# PCIe 1.935 TB/s; element-wise kernels reach about 85% of it.
HBM_EFFICIENCY = 0.85
# A kernel that overlaps with communication on the same GPU runs slower: NCCL's kernels take SMs and
# memory bandwidth. Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning", arXiv 2507.03114, measured an average computational slowdown of 18.9%
# on A100 and H100 GPUs. On one H100 (benchmarks/gpu_overlap.py) a FlashAttention-2 backward block
# beside a copy by 2-4 thread blocks that hold their SMs ran 0.4-1.5% slower, by 8-16 blocks 12-13%,
# by 32 blocks 35%; how many NCCL's send/recv takes for an NVLink peer was not measured here.
OVERLAP_SLOWDOWN = 0.189
# Launching a kernel: CUDA launch latency is a few microseconds; a block call is several kernels
# (attention, merge, casts), and the host enqueues them ahead of the GPU: 5 us per traced block.
LAUNCH_S = 5e-6


# Bytes moved per element by the code that folds a block's results into fp32 accumulators (bf16 inputs):
# (forward per output element, backward per dq element, backward per dK and per dV element).
# seqpar (executor.py, kernels/merge.py): forward, out.to(fp32) (2 + 4) then acc.lerp_(out32, w) (3 x 4);
#   backward, acc += block result (4 + 2 + 4) for dq, and for dK, dV also the wire stack and a fresh
#   accumulator per step (+ 12).
# ring-flash-attention (utils.py _update_out_and_lse, counted unfused): block_out.to(fp32) (6),
#   exp(..) * out (8), exp(..) * block_out (8), their sum (12): 34; backward dq += dq_buffer,
#   dk += dk_buffer, dv += dv_buffer (10 each). Used to check the replay against its published table.
# "none": the kernel alone (flash_attn on one GPU: ring-flash-attention's ideal).
EPILOGUES = {"seqpar": (18, 10, 22), "ring-flash-attention": (34, 10, 10), "none": (0, 0, 0)}


@dataclass(frozen=True)
class KernelModel:
    """Seconds of a traced compute event on a GPU: FLOPs at the published rate for its length and mask
    (interpolated in log length, the table's ends held beyond them; a block shorter than 512 costs as
    much per (query, key) pair as a 512 one), plus the executor's fp32 merges and sums at HBM speed."""

    name: str
    family: str  # "fa2" | "fa3"
    scale: float  # multiplies the H100 table (other GPUs)
    hbm_bytes_per_s: float
    linear_flops_per_s: tuple[float, float]  # (forward, backward)
    overlap_slowdown: float = OVERLAP_SLOWDOWN
    launch_s: float = LAUNCH_S
    merge: str = "seqpar"  # whose epilogue (EPILOGUES)

    def rate(self, pass_: str, mask: str, length: float, head_dim: int) -> float:
        """FLOP/s of a block of ``length`` (geometric mean of its query and key lengths)."""
        table = _TABLES[(self.family, 64 if head_dim <= 96 else 128)]
        none = _interp(table[f"{pass_}_none"], length)
        if mask is None or mask == "none":
            return none * 1e12 * self.scale
        ratio = _interp(table["fwd_causal"], length) / _interp(table["fwd_none"], length)
        return none * ratio * 1e12 * self.scale

    def seconds(self, ev: dict) -> float:
        """The modelled duration of a compute event (see :mod:`seqpar.tracing` for its fields)."""
        name, flops = ev["name"], ev["flops"]
        bwd = name.endswith("bwd") or name.startswith("linear_d") or name.startswith("linear_bwd")
        if name.startswith("linear"):
            return flops / self.linear_flops_per_s[1 if bwd else 0] + self.launch_s
        b, rows, cols, hq, hkv, d = ev["shape"]
        length = math.sqrt(max(rows, 1) * max(cols, 1))
        t = flops / self.rate("bwd" if bwd else "fwd", ev.get("mask"), length, d)
        extra = self.epilogue_bytes(b, rows, cols, hq, hkv, d, bwd)
        if bwd and hkv < hq and self.family == "fa2":
            # FlashAttention-2's backward writes dK, dV for every query head and sums the groups after
            # the kernel (flash-attention, csrc/flash_attn/flash_api.cpp, mha_bwd: dk_expanded, sum_out)
            extra += b * cols * d * 2 * (2 * hq * 2 + hkv * 2)
        return t + extra / self.hbm_bytes_per_s + self.launch_s

    def epilogue_bytes(self, b, rows, cols, hq, hkv, d, bwd: bool) -> float:
        """HBM traffic of folding one block's results into the accumulators: :attr:`merge` bytes per
        output element forward (plus 12 per row and head for the lse), backward per dq element and per
        dK, dV element (:data:`EPILOGUES`)."""
        fwd, dq, dkv = EPILOGUES[self.merge]
        if not bwd:
            return b * rows * hq * (d * fwd + 12)
        return b * d * (rows * hq * dq + 2 * cols * hkv * dkv)


def _interp(values, length: float) -> float:
    """Piecewise linear in log2(length) over :data:`LENGTHS`; the ends held (shorter: per-pair time of 512)."""
    if length <= LENGTHS[0]:
        return values[0] * length / LENGTHS[0]
    if length >= LENGTHS[-1]:
        return values[-1]
    i = bisect.bisect_right(LENGTHS, length) - 1
    x0, x1 = math.log2(LENGTHS[i]), math.log2(LENGTHS[i + 1])
    w = (math.log2(length) - x0) / (x1 - x0)
    return values[i] * (1 - w) + values[i + 1] * w


def _gpu(name: str, family: str, scale: float, hbm: float, linear_scale: float) -> KernelModel:
    return KernelModel(name, family, scale, hbm * HBM_EFFICIENCY,
                       (LINEAR_H100[0] * linear_scale, LINEAR_H100[1] * linear_scale))


KERNELS = {
    "h100-fa3": _gpu("h100-fa3", "fa3", 1.0, 3.35e12, 1.0),
    "h100-fa2": _gpu("h100-fa2", "fa2", 1.0, 3.35e12, 1.0),
    "a100-fa2": _gpu("a100-fa2", "fa2", A100_SCALE, 2.039e12, A100_PEAK_RATIO),
    "a100-pcie-fa2": _gpu("a100-pcie-fa2", "fa2", A100_SCALE, 1.935e12, A100_PEAK_RATIO),
}


@dataclass(frozen=True)
class Machine:
    """Links and compute of the replay. Bandwidths in bytes/s per rank and direction, latencies in
    seconds per message (or per step of a collective). ``kernels`` None: compute takes the traced
    CPU time and the CPU time between events is host work (a replay of runs on this machine)."""

    name: str
    description: str = ""
    ranks_per_node: int = 8
    intra_bw: float = 1e9
    inter_bw: float = 1e9
    intra_lat: float = 0.0
    inter_lat: float = 0.0
    kernels: KernelModel | None = None
    host: bool = True  # count the traced host time between events (False on GPUs: the host runs ahead)
    overlap_slowdown: float = 0.0
    # Cores a transfer takes at each end while it flows (CPU machines: gloo's threads copying over
    # TCP; replay_validate.calibrate_transfer_cpu); 0 on GPUs, where copy engines and NVLink move it.
    transfer_cpu: float = 0.0
    extra: dict = field(default_factory=dict)
    # kind -> (bandwidth, latency): the link a collective of that kind runs its algorithm on, fitted
    # from timing that collective on this machine (replay_validate.calibrate_collectives); kinds
    # absent here use the links of the members. gloo on CPU: its all-gather and reduce-scatter move
    # a chunk 2-4x slower than a point-to-point message of that size (copies through its buffers).
    collectives: dict = field(default_factory=dict)

    def same_node(self, a: int, b: int) -> bool:
        return a // self.ranks_per_node == b // self.ranks_per_node

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth, latency) of a message from rank a to rank b."""
        return (self.intra_bw, self.intra_lat) if self.same_node(a, b) else (self.inter_bw, self.inter_lat)

    def compute_seconds(self, ev: dict) -> float:
        return ev["cpu"] * 1e-9 if self.kernels is None else self.kernels.seconds(ev)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "description", "ranks_per_node", "intra_bw", "inter_bw",
                                           "intra_lat", "inter_lat", "host", "overlap_slowdown",
                                           "transfer_cpu")}
        d["kernels"] = None if self.kernels is None else self.kernels.name
        d["collectives"] = {k: list(v) for k, v in self.collectives.items()}
        return d


def _from_cluster_profile(name: str, kernels: str, description: str | None = None, **changes) -> Machine:
    p = get_profile(changes.pop("cluster_profile", name))
    k = KERNELS[kernels]
    m = Machine(name, description or p.description, p.ranks_per_node, p.intra_node_bandwidth,
                p.inter_node_bandwidth, p.latency_intra, p.latency_inter, k, host=False,
                overlap_slowdown=k.overlap_slowdown)
    return replace(m, **changes)


# H800 SXM5: the H100 SXM5's compute and HBM3 with NVLink cut to 400 GB/s in both directions together
# (NVIDIA H800 datasheet), 200 GB/s per direction; NCCL reaches ~80% of it on large messages (as for
# the H100 profile's 360 of 450): 160e9. Its IB is the H100's (one 400 Gb/s NIC per GPU).
PROFILES = {
    "h100-nvlink-ib": lambda: _from_cluster_profile("h100-nvlink-ib", "h100-fa3"),
    "h800-nvlink-ib": lambda: _from_cluster_profile(
        "h800-nvlink-ib", "h100-fa2", "8x H800 SXM per node, NVLink 400 GB/s bidirectional, 400 Gb/s IB per GPU",
        cluster_profile="h100-nvlink-ib", intra_bw=160e9),
    "a100-nvlink-ib": lambda: _from_cluster_profile("a100-nvlink-ib", "a100-fa2"),
    "pcie": lambda: _from_cluster_profile("pcie", "a100-pcie-fa2"),
}


def machine(name_or_path: str, *, kernels: str | None = None) -> Machine:
    """A named profile (:data:`PROFILES`) or a ``seqpar calibrate`` file / saved :class:`Machine` JSON
    (traced CPU compute, its measured 2-rank point-to-point link). ``kernels`` overrides the GPU
    kernel model (:data:`KERNELS`). ValueError naming the profile or file."""
    if name_or_path in PROFILES:
        m = PROFILES[name_or_path]()
    else:
        m = load_machine(name_or_path)
    if kernels is not None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is not known; choose from {', '.join(KERNELS)}")
        # a GPU's kernels: no host work, the GPU's overlap slowdown, and no CPU taken by transfers
        m = replace(m, kernels=KERNELS[kernels], host=False, overlap_slowdown=KERNELS[kernels].overlap_slowdown,
                    transfer_cpu=0.0)
    return m


def load_machine(path: str | Path) -> Machine:
    """A machine from a JSON file: ``{"format": "seqpar-machine", ...}`` (:meth:`Machine.to_dict`) or a
    ``seqpar calibrate`` file (its measured point-to-point link of the smallest group)."""
    source = f"profile {str(path)!r}"
    if not Path(path).exists():
        raise ValueError(f"{source}: neither a known profile ({', '.join(PROFILES)}) nor a file")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object")
    try:
        if data.get("format") == "seqpar-machine":
            fields_ = {k: data[k] for k in ("name", "ranks_per_node", "intra_bw", "inter_bw", "intra_lat",
                                            "inter_lat")}
            k = data.get("kernels")
            colls = {kind: (float(bw), float(lat)) for kind, (bw, lat) in data.get("collectives", {}).items()}
            if float(data.get("transfer_cpu", 0.0)) < 0:
                raise ValueError(f"transfer_cpu={data['transfer_cpu']} < 0 (cores a transfer takes per end)")
            return Machine(**fields_, description=data.get("description", ""),
                           kernels=KERNELS[k] if k else None, host=bool(data.get("host", k is None)),
                           overlap_slowdown=float(data.get("overlap_slowdown", 0.0)),
                           transfer_cpu=float(data.get("transfer_cpu", 0.0)), collectives=colls)
        if data.get("format") == "seqpar-calibration":
            links = [e for e in data["cluster"].get("measured_links", []) if e[1] == "p2p"]
            size, _, bw, lat = min(links)
            cl = data["cluster"]
            return Machine(f"calibrated:{Path(path).name}", "measured by seqpar calibrate", cl["ranks_per_node"],
                           float(bw), float(bw), float(lat), float(lat))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: missing or bad field ({type(exc).__name__}: {exc})") from None
    raise ValueError(f"{source}: expected format 'seqpar-machine' or 'seqpar-calibration', got "
                     f"{data.get('format')!r}")


def save_machine(m: Machine, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"format": "seqpar-machine", **m.to_dict()}, indent=2) + "\n")


__all__ = ["KERNELS", "KernelModel", "Machine", "PROFILES", "load_machine", "machine", "save_machine"]
