"""The cluster the scheduler plans for: ranks, nodes, bandwidth and latency by group size, memory.

A :class:`ClusterSpec` is a frozen description, built once and passed explicitly. Sequence-parallel
groups are power-of-two blocks of ranks on aligned ranges (a group of size ``d`` starts at a multiple
of ``d``). With ``ranks_per_node`` a power of two, an aligned block of size ``d <= ranks_per_node``
lies inside one node and a larger one is made of whole nodes, so the link a group uses depends only
on its size: :meth:`ClusterSpec.bandwidth` and :meth:`ClusterSpec.latency` take the group size.

Measured machines (``seqpar calibrate``, :mod:`.calibrate`) add three things a datasheet does not give:
per-size measured links (``measured_links``: point-to-point, all-to-all and all-gather bandwidth and latency of an
aligned group of each size, which override the intra/inter constants), the fraction of overlappable
communication that really hides under compute (``overlap_factor``), and the compute slowdown when
several ranks share the cores of one node (``compute_slowdown_by_ranks`` / ``cores``: on a 2-core CPU,
8 single-thread ranks each compute about 4x slower than one rank alone; GPUs have a device per rank).

Named bandwidth profiles for the simulator (``seqpar simulate``) are in :data:`PROFILES`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import numpy as np


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ... (and False for 0, negatives and non-integers)."""
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


# Defaults for one 8x H100 SXM node per 8 ranks, with one 400 Gb/s InfiniBand NIC per GPU.
#
# intra-node: NVLink 4 gives each H100 SXM 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s
#   bidirectional, NVIDIA H100 datasheet). NCCL all-to-all and send/recv through NVSwitch reach about
#   80% of that on large messages (nccl-tests busbw on DGX H100 is 350-370 GB/s): 360e9 bytes/s.
# inter-node: ConnectX-7 NDR, 400 Gb/s = 50e9 bytes/s per direction per GPU; NCCL over IB reaches
#   about 90% (~45 GB/s busbw per NIC): 45e9 bytes/s.
# latency: the fixed cost of one message or collective step. NCCL small-message latency is a few
#   microseconds inside a node and ~10-20 us across IB; we take 8 us and 15 us.
# memory: H100 SXM has 80 GB of HBM3 (about 79 GiB visible to CUDA): 80e9 bytes.
H100_INTRA_NODE_BANDWIDTH = 360e9
H100_INTER_NODE_BANDWIDTH = 45e9
H100_LATENCY_INTRA = 8e-6
H100_LATENCY_INTER = 15e-6
H100_MEMORY = 80e9
LINK_KINDS = ("p2p", "all_to_all", "all_gather")


@dataclass(frozen=True)
class ClusterSpec:
    """Ranks, nodes, links and memory of the machine a batch is planned for.

    Attributes:
        world_size: number of ranks (GPUs). A whole number of nodes, or a power of two that fits in
            one node.
        ranks_per_node: ranks sharing the fast intra-node link; a power of two (so aligned groups
            never straddle a node boundary).
        intra_node_bandwidth: bytes/s one rank sends (per direction) to ranks of its own node.
        inter_node_bandwidth: bytes/s one rank sends (per direction) to ranks on other nodes.
        memory_per_rank: bytes of device memory per rank.
        latency_intra: seconds of fixed cost per message / collective step inside a node.
        latency_inter: the same across nodes.
        cores: compute units shared by the ranks of one node (CPU cores); 0 means one device per
            rank (GPUs), so ranks never slow each other's compute.
        compute_slowdown_by_ranks: measured ``((k, factor), ...)``: compute time of a kernel when k
            ranks of one node run it at once, over its time on one rank alone (``seqpar calibrate``).
        measured_links: measured ``((group_size, kind, bytes_per_s, latency_s), ...)`` with kind
            ``"p2p"`` (ring exchange: every rank sends to its successor; bytes = sent per rank),
            ``"all_to_all"`` (bytes = sent per rank) or ``"all_gather"`` (bytes = received per rank);
            an entry overrides the intra/inter constants for its size and kind.
        overlap_factor: fraction (0..1) of the communication a method overlaps with compute that
            actually hides behind it (1 = perfect, the GPU default; measured on CPU gloo).

    The default numbers (see :meth:`h100`) are for 8x H100 SXM per node (NVLink 4 + NVSwitch) and one
    400 Gb/s NDR InfiniBand NIC per GPU; the reasoning is next to the constants in this module.
    """

    world_size: int
    ranks_per_node: int = 8
    intra_node_bandwidth: float = H100_INTRA_NODE_BANDWIDTH
    inter_node_bandwidth: float = H100_INTER_NODE_BANDWIDTH
    memory_per_rank: float = H100_MEMORY
    latency_intra: float = H100_LATENCY_INTRA
    latency_inter: float = H100_LATENCY_INTER
    cores: float = 0.0
    compute_slowdown_by_ranks: tuple[tuple[int, float], ...] = ()
    measured_links: tuple[tuple[int, str, float, float], ...] = ()
    overlap_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if not is_power_of_two(self.ranks_per_node):
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must be a power of two so that aligned power-of-two "
                f"groups never straddle a node boundary")
        n, rpn = self.world_size, self.ranks_per_node
        if not (n % rpn == 0 or (n < rpn and is_power_of_two(n))):
            raise ValueError(
                f"world_size={n} cannot be tiled by aligned power-of-two groups with ranks_per_node={rpn}: "
                f"use a whole number of nodes (a multiple of {rpn}) or a power of two below {rpn}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "memory_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
        for name in ("latency_intra", "latency_inter"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name}: expected a non-negative finite number of seconds, got {value!r}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, (int, float)) or not 0 <= self.cores < math.inf:
            raise ValueError(f"cores: expected a non-negative finite number (0 = one device per rank), got "
                             f"{self.cores!r}")
        if isinstance(self.overlap_factor, bool) or not isinstance(self.overlap_factor, (int, float)) \
                or not 0 <= self.overlap_factor <= 1:
            raise ValueError(f"overlap_factor: expected a number in [0, 1], got {self.overlap_factor!r}")
        table = []
        for entry in self.compute_slowdown_by_ranks:
            try:
                k, factor = entry
            except (TypeError, ValueError):
                raise ValueError(f"compute_slowdown_by_ranks: expected (ranks, factor) pairs, got {entry!r}") from None
            if not isinstance(k, int) or isinstance(k, bool) or k < 1 or not isinstance(factor, (int, float)) \
                    or isinstance(factor, bool) or not 0 < factor < math.inf:
                raise ValueError(f"compute_slowdown_by_ranks: entry {entry!r} needs a positive integer rank count "
                                 f"and a positive finite factor")
            table.append((int(k), float(factor)))
        object.__setattr__(self, "compute_slowdown_by_ranks", tuple(sorted(table)))
        links = []
        for entry in self.measured_links:
            try:
                size, kind, bw, lat = entry
            except (TypeError, ValueError):
                raise ValueError(f"measured_links: expected (group_size, kind, bytes_per_s, latency_s), "
                                 f"got {entry!r}") from None
            if not is_power_of_two(size) or kind not in LINK_KINDS:
                raise ValueError(f"measured_links: entry {entry!r} needs a power-of-two group size and a kind "
                                 f"in {LINK_KINDS}")
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < math.inf:
                raise ValueError(f"measured_links: bandwidth of {entry!r} must be positive and finite")
            if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < math.inf:
                raise ValueError(f"measured_links: latency of {entry!r} must be non-negative and finite")
            links.append((int(size), str(kind), float(bw), float(lat)))
        object.__setattr__(self, "measured_links", tuple(sorted(links)))

    @classmethod
    def h100(cls, world_size: int = 8, ranks_per_node: int = 8) -> "ClusterSpec":
        """8x H100 SXM per node, NVLink 4 inside the node, 400 Gb/s IB per GPU across nodes."""
        return cls(world_size=world_size, ranks_per_node=ranks_per_node)

    @property
    def num_nodes(self) -> int:
        """Nodes in use (a partial node counts as one)."""
        return max(1, self.world_size // self.ranks_per_node)

    @property
    def max_group_size(self) -> int:
        """Largest power of two that fits in the world."""
        return 1 << (self.world_size.bit_length() - 1)

    def group_sizes(self) -> tuple[int, ...]:
        """All group sizes a plan may use: 1, 2, 4, ..., :attr:`max_group_size`."""
        return tuple(1 << k for k in range(self.max_group_size.bit_length()))

    def intra_node(self, group_size: int) -> bool:
        """True when an aligned group of this size stays inside one node."""
        return group_size <= self.ranks_per_node

    def bandwidth(self, group_size: int, kind: str = "p2p") -> float:
        """Bytes/s per rank and direction for a group of ``group_size`` ranks (intra if it fits a node).

        ``kind`` is ``"p2p"`` (ring exchanges), ``"all_to_all"`` or ``"all_gather"``; they differ only
        where :attr:`measured_links` has an entry for this size.
        """
        self._check_size(group_size)
        link = self._link(group_size, kind)
        if link is not None:
            return link[2]
        return self.intra_node_bandwidth if self.intra_node(group_size) else self.inter_node_bandwidth

    def latency(self, group_size: int, kind: str = "p2p") -> float:
        """Seconds of fixed cost per message or collective step inside a group of this size."""
        self._check_size(group_size)
        link = self._link(group_size, kind)
        if link is not None:
            return link[3]
        return self.latency_intra if self.intra_node(group_size) else self.latency_inter

    def compute_slowdown(self, active_ranks: int | None = None) -> float:
        """Factor (>= 1 on shared cores) by which each rank's compute is slower when ``active_ranks``
        ranks (default: the whole world) compute at once, counted per node.

        A measured entry of :attr:`compute_slowdown_by_ranks` wins; beyond the largest measured count
        the factor grows in proportion to the ranks (cores are already shared); without measurements
        it is ``max(1, ranks / cores)``; with ``cores == 0`` (a device per rank) it is 1.
        """
        n = self.world_size if active_ranks is None else active_ranks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"active_ranks: expected a positive integer, got {active_ranks!r}")
        k = min(n, self.ranks_per_node)
        table = dict(self.compute_slowdown_by_ranks)
        if k in table:
            return table[k]
        below = [m for m in table if m <= k]
        if below:
            m = max(below)
            return table[m] * max(1.0, k / (max(m, self.cores) if self.cores else m))
        return max(1.0, k / self.cores) if self.cores else 1.0

    @property
    def shares_cores(self) -> bool:
        """True when more ranks of a node compute at once than it has :attr:`cores` (CPU ranks)."""
        return bool(self.cores) and min(self.world_size, self.ranks_per_node) > self.cores

    def work_scale(self) -> float:
        """``1 / (cores x nodes)`` when ranks share cores, else 0: a plan takes at least its total
        single-rank compute times this (every core busy all along); :meth:`shared_makespan` is the
        finer model."""
        return 1.0 / (self.cores * self.num_nodes) if self.shares_cores else 0.0

    def shared_makespan(self, rank_work) -> float:
        """Seconds until every rank is done when ``rank_work[r]`` is rank r's compute alone (seconds)
        and each node's :attr:`cores` are shared fairly among its busy ranks (processor sharing):
        with m busy ranks each runs at ``min(1, cores / m)`` of its speed, divided by the measured
        contention beyond time sharing, ``compute_slowdown(m) / max(1, m / cores)`` (at least 1).
        A rank that is done (or waits for a message) leaves its share to the others."""
        work = np.asarray(rank_work, dtype=np.float64)
        if len(work) != self.world_size:
            raise ValueError(f"rank_work: expected {self.world_size} entries, got {len(work)}")
        if not self.shares_cores:
            return float(work.max(initial=0.0))
        worst = 0.0
        for node in work.reshape(-1, min(self.world_size, self.ranks_per_node)):
            done, t, busy = 0.0, 0.0, np.sort(node[node > 0])
            for i, w in enumerate(busy):
                m = len(busy) - i
                contention = max(1.0, self.compute_slowdown(m) / max(1.0, m / self.cores))
                t += (w - done) * contention / min(1.0, self.cores / m)
                done = w
            worst = max(worst, t)
        return worst

    def with_world_size(self, world_size: int) -> "ClusterSpec":
        """The same machine with another number of ranks (validated like the constructor)."""
        return replace(self, world_size=world_size)

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "cluster") -> "ClusterSpec":
        """Build from :meth:`to_dict` output (JSON lists become tuples); ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected an object of ClusterSpec fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}")
        if "world_size" not in data:
            raise ValueError(f"{source}: field 'world_size' is missing")
        kwargs = dict(data)
        for name in ("compute_slowdown_by_ranks", "measured_links"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise ValueError(f"{source}: {name}: expected a list of entries")
                kwargs[name] = tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in kwargs[name])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def aligned_blocks(self, group_size: int) -> tuple[int, ...]:
        """Start ranks of the aligned blocks of ``group_size`` ranks that fit in the world."""
        self._check_size(group_size)
        return tuple(range(0, self.world_size - group_size + 1, group_size))

    def to_dict(self) -> dict:
        """Plain dict (JSON-friendly) of the fields."""
        return asdict(self)

    def _link(self, group_size: int, kind: str):
        if kind not in LINK_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {LINK_KINDS}")
        for entry in self.measured_links:
            if entry[0] == group_size and entry[1] == kind:
                return entry
        return None

    def _check_size(self, group_size: int) -> None:
        if not is_power_of_two(group_size) or group_size > self.world_size:
            raise ValueError(
                f"group_size={group_size!r} must be a power of two no larger than world_size={self.world_size}")


# ----------------------------------------------------------------------------- named profiles
@dataclass(frozen=True)
class BandwidthProfile:
    """A named machine for ``seqpar simulate``: links per GPU and the GPU's effective FLOP rates.

    Bandwidths are bytes/s per GPU and direction that collectives reach on large messages (not the
    datasheet peak); ``attention_flops`` / ``gemm_flops`` feed :meth:`CostModel.default`.
    """

    name: str
    description: str
    ranks_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    latency_intra: float
    latency_inter: float
    memory_per_rank: float
    attention_flops: float
    gemm_flops: float

    def cluster(self, world_size: int) -> ClusterSpec:
        """The :class:`ClusterSpec` of ``world_size`` GPUs of this kind."""
        return ClusterSpec(world_size=world_size, ranks_per_node=self.ranks_per_node,
                           intra_node_bandwidth=self.intra_node_bandwidth,
                           inter_node_bandwidth=self.inter_node_bandwidth, memory_per_rank=self.memory_per_rank,
                           latency_intra=self.latency_intra, latency_inter=self.latency_inter)


PROFILES: dict[str, BandwidthProfile] = {p.name: p for p in (
    # DGX/HGX H100: NVLink 4 through NVSwitch, 18 links x 25 GB/s = 450 GB/s per direction per GPU
    # (NVIDIA H100 datasheet); nccl-tests all-reduce/all-to-all busbw on DGX H100 is ~350-370 GB/s: 360e9.
    # One ConnectX-7 NDR NIC per GPU, 400 Gb/s = 50 GB/s per direction, NCCL reaches ~90%: 45e9.
    # Compute as in cost.py: 400 TFLOP/s flash attention fwd+bwd, 450 TFLOP/s GEMMs (bf16).
    BandwidthProfile("h100-nvlink-ib", "8x H100 SXM per node, NVSwitch 450 GB/s/dir, 400 Gb/s IB per GPU",
                     8, H100_INTRA_NODE_BANDWIDTH, H100_INTER_NODE_BANDWIDTH, H100_LATENCY_INTRA,
                     H100_LATENCY_INTER, H100_MEMORY, 400e12, 450e12),
    # HGX H200: the same NVLink 4 / NVSwitch fabric and the same 400 Gb/s ConnectX-7 per GPU as H100
    # (NVIDIA H200 datasheet), 141 GB HBM3e at 4.8 TB/s. Same dense bf16 peak (989 TFLOP/s); the faster
    # memory helps attention a little: 420 TFLOP/s attention, 450 GEMMs.
    BandwidthProfile("h200-nvlink-ib", "8x H200 SXM per node, NVSwitch 450 GB/s/dir, 400 Gb/s IB per GPU",
                     8, H100_INTRA_NODE_BANDWIDTH, H100_INTER_NODE_BANDWIDTH, H100_LATENCY_INTRA,
                     H100_LATENCY_INTER, 141e9, 420e12, 450e12),
    # DGX A100: NVLink 3, 12 links x 25 GB/s = 300 GB/s per direction (A100 datasheet); nccl-tests busbw
    # ~230-240 GB/s: 240e9. One HDR 200 Gb/s NIC per GPU = 25 GB/s, ~90%: 22.5e9. A100 bf16 peak is
    # 312 TFLOP/s; FlashAttention-2 reaches ~190 TFLOP/s fwd+bwd (FA2 paper), GEMMs ~50% MFU: 160.
    BandwidthProfile("a100-nvlink-ib", "8x A100 SXM per node, NVSwitch 300 GB/s/dir, 200 Gb/s IB per GPU",
                     8, 240e9, 22.5e9, 10e-6, 20e-6, 80e9, 190e12, 160e12),
    # 8 GPUs on PCIe Gen4 x16 (32 GB/s per direction nominal), peer-to-peer through PCIe switches and the
    # host bridge: ~20 GB/s when all GPUs talk at once. 100 Gb/s Ethernet/RoCE per node shared by its 8
    # GPUs would be 1.5 GB/s each; we assume one 100 Gb/s NIC per 2 GPUs (~5.5 GB/s each after
    # overheads). A100-80GB-PCIe-class compute.
    BandwidthProfile("pcie", "8x A100 PCIe per node, PCIe Gen4 P2P ~20 GB/s, 100 Gb/s Ethernet per 2 GPUs",
                     8, 20e9, 5.5e9, 15e-6, 25e-6, 80e9, 190e12, 160e12),
)}


def get_profile(name: str) -> BandwidthProfile:
    """The named profile; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise ValueError(f"profile={name!r} is not known; choose from {', '.join(PROFILES)}") from None


def _size_table(name: str, entries, width: int) -> tuple:
    """Validate ``((group size, factor × width), ...)``; sorted by size, factors as floats."""
    table = {}
    for entry in entries:
        try:
            d, *ks = entry
        except (TypeError, ValueError):
            ks = None
        if ks is None or len(ks) != width:
            raise ValueError(f"{name}: expected (group size, {width} factor(s)) entries, got {entry!r}")
        if not (isinstance(d, int) and not isinstance(d, bool) and is_power_of_two(d)) or not all(
                isinstance(k, (int, float)) and not isinstance(k, bool) and 0 < k < math.inf for k in ks):
            raise ValueError(f"{name}: entry {entry!r} needs a power-of-two group size and positive finite factors")
        table[d] = tuple(float(k) for k in ks)
    return tuple((d, *k) for d, k in sorted(table.items()))


def check_file_keys(data: dict, known, source: str) -> None:
    """A model or calibration file's top-level keys are ``known`` and its version 1: a misspelt key
    would otherwise be ignored (its values replaced by defaults), a newer file read as this one."""
    unknown = sorted(set(data) - set(known))
    if unknown or data.get("version", 1) != 1:
        raise ValueError(f"{source}: unknown key(s) {unknown} or version {data.get('version')!r}: this seqpar "
                         f"reads version 1 with keys {', '.join(sorted(known))}; re-create the file")


def _lookup(table: tuple, group_size: int, default: tuple) -> tuple:
    """The factors of ``group_size`` in a :func:`_size_table`: that size, else the nearest below, else above."""
    if not table:
        return default
    below = [k for d, *k in table if d <= group_size]
    return tuple(below[-1] if below else table[0][1:])
