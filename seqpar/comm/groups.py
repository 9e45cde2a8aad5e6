"""Process-group resolution: every primitive takes the group explicitly.

``group`` may be ``None`` (the default world group, or a single device when torch.distributed is
not initialised), a ``ProcessGroup``, or a 1-D ``DeviceMesh``. Nothing is cached globally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupInfo:
    """This rank's view of a sequence-parallel group.

    ``rank``/``size`` are positions inside the group; ``global_ranks[i]`` is the global rank of group
    member ``i`` (P2P ops address peers by global rank). ``group`` is None for a single device.
    """

    group: object
    rank: int
    size: int
    global_ranks: tuple[int, ...]

    def peer(self, offset: int) -> int:
        """Global rank of the member ``offset`` places after this one on the ring."""
        return self.global_ranks[(self.rank + offset) % self.size]

    @property
    def single(self) -> bool:
        return self.size == 1


def _is_device_mesh(obj) -> bool:
    return type(obj).__name__ == "DeviceMesh" and hasattr(obj, "get_group")


def resolve_group(group=None, *, argument: str = "group"):
    """Return the ``ProcessGroup`` behind ``group`` (None when running on a single device).

    Raises ``ValueError`` naming ``argument`` for a wrong type or a mesh that is not 1-D.
    """
    if _is_device_mesh(group):
        if group.ndim != 1:
            raise ValueError(
                f"{argument}: a {group.ndim}-D DeviceMesh was given, but this method needs a 1-D mesh "
                f"(pass mesh['axis_name'] for one axis; the 'usp' method takes a 2-D mesh)"
            )
        return group.get_group()
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise ValueError(
        f"{argument}: expected None, a torch.distributed ProcessGroup or a DeviceMesh, got {type(group).__name__}"
    )


def group_info(group=None, *, argument: str = "group") -> GroupInfo:
    """Resolve ``group`` and describe this rank's place in it."""
    pg = resolve_group(group, argument=argument)
    if pg is None:
        return GroupInfo(None, 0, 1, (0,))
    size = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    if pg is dist.group.WORLD:
        ranks = tuple(range(size))
    else:
        ranks = tuple(dist.get_process_group_ranks(pg))
    return GroupInfo(pg, rank, size, ranks)


def collective_device(group=None) -> torch.device:
    """Where tensors that only travel through a collective of ``group`` belong (counts, timings,
    fingerprints, benchmark inputs): the current CUDA device when the group's backend takes CUDA
    tensors only (NCCL), else the CPU (gloo, or no process group). NCCL rejects a CPU tensor."""
    pg = resolve_group(group)
    if pg is None:
        return torch.device("cpu")
    try:  # the devices the group's backends serve; not a public attribute, hence the fallback
        types = {d.type for d in pg._device_types}
    except AttributeError:
        types = {"cuda"} if str(dist.get_backend(pg)) == "nccl" else {"cpu"}
    if types == {"cuda"}:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
