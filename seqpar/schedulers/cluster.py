"""The cluster the scheduler plans for: ranks, nodes, bandwidth and latency by group size, memory.

A :class:`ClusterSpec` is a frozen description, built once and passed explicitly. Sequence-parallel
groups are power-of-two blocks of ranks on aligned ranges (a group of size ``d`` starts at a multiple
of ``d``). With ``ranks_per_node`` a power of two, an aligned block of size ``d <= ranks_per_node``
lies inside one node and a larger one is made of whole nodes, so the link a group uses depends only
on its size: :meth:`ClusterSpec.bandwidth` and :meth:`ClusterSpec.latency` take the group size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def bandwidth(self, group_size: int) -> float:
        """Bytes/s per rank and direction for a group of ``group_size`` ranks (intra if it fits a node)."""
        self._check_size(group_size)
        return self.intra_node_bandwidth if self.intra_node(group_size) else self.inter_node_bandwidth

    def latency(self, group_size: int) -> float:
        """Seconds of fixed cost per message or collective step inside a group of this size."""
        self._check_size(group_size)
        return self.latency_intra if self.intra_node(group_size) else self.latency_inter

    def aligned_blocks(self, group_size: int) -> tuple[int, ...]:
        """Start ranks of the aligned blocks of ``group_size`` ranks that fit in the world."""
        self._check_size(group_size)
        return tuple(range(0, self.world_size - group_size + 1, group_size))

    def to_dict(self) -> dict:
        """Plain dict (JSON-friendly) of the fields."""
        return asdict(self)

    def _check_size(self, group_size: int) -> None:
        if not is_power_of_two(group_size) or group_size > self.world_size:
            raise ValueError(
                f"group_size={group_size!r} must be a power of two no larger than world_size={self.world_size}")
