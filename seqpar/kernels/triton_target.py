"""Autotune configurations of seqpar's Triton attention kernels, and what one NVIDIA GPU can run of
them: its architecture, its shared memory per block, the configurations that fit it.

A configuration whose tiles need more shared memory than the device has fails at launch with
``OutOfResources`` (Triton's autotuner skips it while benchmarking, but crashes when every
configuration fails, and does not benchmark at all when pruning leaves one). So every autotuned
kernel prunes with :func:`pruner` (the table of its dtype and head dim, then what fits
:func:`device_target`), and the Triton backend refuses a case no configuration fits
(:func:`no_fit_reason`, naming the smallest requirement), so that dispatch picks the next backend.

Shared memory is estimated from the tiles (:func:`smem_estimate`); the ahead-of-time compilation
suite (``tests/test_gpu_static_triton.py``) checks that the estimate bounds what Triton really
allocates, for every configuration, on sm_80, sm_89 and sm_90.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

#: Shared memory per thread block (the opt-in maximum, bytes) by compute capability (major * 10 +
#: minor), from the CUDA C++ Programming Guide's table of compute-capability limits; used when the
#: device does not report it (and by the static checks, which have no device).
SMEM_PER_BLOCK = {
    70: 98_304, 72: 98_304, 75: 65_536,
    80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376,
    90: 232_448, 100: 232_448, 101: 232_448, 103: 232_448, 120: 101_376, 121: 101_376,
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU architecture: ``arch`` = compute capability as ``major * 10 + minor``, ``smem`` = shared
    memory one thread block may use, in bytes."""

    arch: int
    smem: int

    @property
    def name(self) -> str:
        return f"sm_{self.arch}"

    @classmethod
    def of(cls, arch: int) -> "Target":
        """The target of a compute capability in :data:`SMEM_PER_BLOCK`."""
        if arch not in SMEM_PER_BLOCK:
            raise ValueError(f"arch={arch}: unknown compute capability, use one of {sorted(SMEM_PER_BLOCK)}")
        return cls(arch, SMEM_PER_BLOCK[arch])


def device_target(device: torch.device) -> Target | None:
    """The :class:`Target` of a CUDA ``device`` (its own report of shared memory where torch exposes
    it, else :data:`SMEM_PER_BLOCK`), or ``None`` for any other device (the CPU interpreter has no
    shared-memory limit)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    arch = major * 10 + minor
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return Target(arch, int(smem) or SMEM_PER_BLOCK.get(arch, SMEM_PER_BLOCK[75]))


def device_guard(t: torch.Tensor):
    """Make ``t``'s CUDA device current for a launch (Triton launches on the current device, which
    need not be the tensor's); a no-op context for CPU tensors."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ------------------------------------------------------------------------------ configurations
# (BLOCK_M, BLOCK_N, num_warps, num_stages) by kernel, input width ("half": fp16 / bf16, "fp32")
# and the largest BLOCK_D served; a head dim takes the first table whose bound is >= its BLOCK_D.
# Chosen from ptxas's reports for sm_90 / sm_80 (benchmarks/results/gpu_static/triton_aot_full.md):
# every half-precision configuration up to D = 128 runs without spills on sm_90. The dk/dv kernel
# holds K, V and the fp32 dK, dV of BLOCK_N keys in registers: at D = 128 only BLOCK_N = 32 ran
# without spills on sm_90 (32x128 with 4 warps spilled 3.6 KB per thread there and 25 KB on sm_80),
# and 64x32 spilled 24-44 B at D = 32. The 128x128 forward tile sits at 255 registers from D = 96 on
# (72 B of spills with a sliding window at D = 128), so it serves D <= 64 only.
# fp32 uses IEEE fp32 dots (no tensor cores) and needs small tiles and 8 warps: 64x64 spilled
# 25-57 KB per thread, and at D = 256 even 32x32 with 4 warps spilled 36-57 KB on sm_90; these spill
# at most ~0.5 KB. fp16 / bf16 fit sm_86 / sm_89 (101,376 B) up to D = 256, fp32 up to D = 128 (and
# the D = 256 forward).
CONFIGS: dict[str, dict[tuple[str, int], list[tuple[int, int, int, int]]]] = {
    "fwd": {
        ("half", 64): [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 8, 4), (64, 32, 4, 2)],
        ("half", 128): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 4), (64, 32, 4, 2)],
        ("half", 256): [(128, 32, 8, 4), (64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
        ("fp32", 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
        ("fp32", 128): [(32, 16, 8, 2), (32, 32, 8, 2)],
        ("fp32", 256): [(32, 32, 8, 2), (32, 16, 8, 2)],
    },
    "dq": {
        ("half", 128): [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 2)],
        ("half", 256): [(128, 32, 8, 3), (64, 32, 8, 2), (32, 32, 4, 2)],
        ("fp32", 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
        ("fp32", 128): [(32, 32, 8, 2), (32, 32, 4, 2)],
        ("fp32", 256): [(32, 32, 8, 2), (16, 32, 4, 2)],
    },
    "dkdv": {
        ("half", 64): [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (32, 32, 4, 3)],
        ("half", 128): [(16, 128, 8, 2), (16, 128, 8, 1), (16, 64, 8, 2),
                        (64, 32, 8, 3), (32, 32, 8, 3), (32, 32, 4, 3)],
        ("half", 256): [(64, 32, 8, 3), (32, 32, 8, 3), (32, 32, 8, 2)],
        ("fp32", 64): [(32, 32, 8, 2), (16, 32, 4, 2)],
        ("fp32", 128): [(16, 32, 4, 2), (32, 16, 8, 2)],
        ("fp32", 256): [(16, 32, 8, 2)],
    },
}
KERNEL_TITLES = {"fwd": "forward", "dq": "dq", "dkdv": "dk/dv"}

# Hopper's tensor-core instruction (wgmma) needs 64 rows per warpgroup in the first operand of a dot;
# the dk/dv kernel's first operand is its BLOCK_N keys, so at D = 128 its last three configurations
# (BLOCK_N = 32: the largest that fit the registers next to the fp32 dK, dV at 4 warps) compile to
# Ampere's mma.sync on sm_90 (the ahead-of-time suite records the instruction per variant). The first
# three take BLOCK_N = 64 / 128 over 8 warps with 16 query rows per step: wgmma, without spills on
# sm_90 at 160-255 registers for GROUP 1, 2 and 4, every mask and path (16x128 with 2 stages except
# the causal variants, see SPILLING). On sm_80 / sm_89 they spill and run mma.sync, so they are
# offered on sm_90 and later only (HOPPER_ONLY); the autotuner times them against the others there.
# They come first in the table so that the ahead-of-time suite's first-configuration cases compile
# one of them on sm_90.
HOPPER_ONLY: frozenset = frozenset({("dkdv", "half", 128, c) for c in ((16, 128, 8, 2), (16, 128, 8, 1),
                                                                      (16, 64, 8, 2))})

# Configurations left out of some kernel variants because ptxas spills there (ahead-of-time
# compilation, tests/test_gpu_static_triton.py), keyed by (kernel, "half" | "fp32", table bound of D,
# IS_VARLEN, HAS_WINDOW, IS_CAUSAL); the other variants keep them:
# - the packed dq kernel with a window (as packed dispatch launches it for windowed documents) at
#   64x64 with 4 warps reaches the 255-register cap for fp16 / bf16 D = 128 and spills 4 B per thread
#   on sm_90;
# - the causal dk/dv kernel at 16x128 with 2 stages (its two masked spans beside the unmasked one)
#   spills 4-72 B per thread on sm_90 for GROUP >= 2, dense, packed and windowed.
_CAUSAL_DKDV = frozenset({(16, 128, 8, 2)})
SPILLING: dict[tuple, frozenset] = {
    **{("dq", "half", 128, True, True, causal): frozenset({(64, 64, 4, 3)}) for causal in (False, True)},
    **{("dkdv", "half", 128, varlen, window, True): _CAUSAL_DKDV for varlen in (False, True)
       for window in (False, True)},
}


def all_configs(kernel: str) -> list[tuple[int, int, int, int]]:
    """Every configuration of ``kernel`` in any table (the autotuner's list), without repeats."""
    return list(dict.fromkeys(c for table in CONFIGS[kernel].values() for c in table))


def table(kernel: str, elem_bytes: int, block_d: int) -> list[tuple[int, int, int, int]]:
    """The configurations of ``kernel`` for inputs of ``elem_bytes`` (2 or 4) and ``block_d``."""
    width = "fp32" if elem_bytes == 4 else "half"
    bounds = sorted(b for w, b in CONFIGS[kernel] if w == width)
    bound = next((b for b in bounds if b >= block_d), None)
    if bound is None:
        raise ValueError(f"BLOCK_D={block_d}: the Triton kernels serve BLOCK_D <= {bounds[-1]}")
    return CONFIGS[kernel][(width, bound)]


def smem_estimate(kernel: str, cfg: tuple[int, int, int, int], block_d: int, elem_bytes: int,
                  arch: int) -> int:
    """Upper bound (bytes) of the shared memory Triton allocates for one program of ``kernel``.

    Staged tiles are the ones the loop software-pipelines (K, V for forward and dq; Q, dO and their
    fp32 lse, delta for dk/dv), fixed tiles stay for the whole program (Q; Q, dO; K, V). Ampere's
    pipeline (mma v2, and every fp32 IEEE dot) keeps ``stages - 1`` staged tiles plus an fp32
    layout-conversion tile of the scores (at least 32x32); Hopper's wgmma path keeps ``stages``
    tiles as operands. Compiled for sm_80 / sm_90 the bound is exact for most configurations and at
    most ~1.7x too high for small tiles (checked by the static suite for every configuration).
    """
    bm, bn, _warps, stages = cfg
    if kernel == "fwd":
        staged, fixed, rows = 2 * bn * block_d * elem_bytes, bm * block_d * elem_bytes, bm
    elif kernel == "dq":
        staged, fixed, rows = 2 * bn * block_d * elem_bytes, 2 * bm * block_d * elem_bytes, bm
    elif kernel == "dkdv":
        staged, fixed, rows = 2 * bm * (block_d * elem_bytes + 4), 2 * bn * block_d * elem_bytes, bn
    else:
        raise ValueError(f"kernel={kernel!r}: use one of {sorted(CONFIGS)}")
    need = max(stages - 1, 1) * staged + fixed + max(bm, 32) * max(bn, 32) * 4 + rows * 4
    if arch >= 90 or stages < 2:
        need = max(need, max(stages, 2) * staged + fixed + rows * 4)
    return need


def fitting(kernel: str, elem_bytes: int, block_d: int, target: Target | None):
    """The configurations of the table that fit ``target``'s shared memory and are offered on its
    architecture (:data:`HOPPER_ONLY`); all of them when ``target`` is None."""

    def offered(c) -> bool:
        return (smem_estimate(kernel, c, block_d, elem_bytes, target.arch) <= target.smem
                and (target.arch >= 90 or _key(kernel, elem_bytes, block_d, c) not in HOPPER_ONLY))

    return [c for c in table(kernel, elem_bytes, block_d) if target is None or offered(c)]


def no_fit_reason(kernels, elem_bytes: int, block_d: int, target: Target | None) -> str | None:
    """Why no configuration of one of ``kernels`` fits ``target``, or ``None`` when each has one."""
    for kernel in kernels:
        if target is not None and not fitting(kernel, elem_bytes, block_d, target):
            need = min(smem_estimate(kernel, c, block_d, elem_bytes, target.arch)
                       for c in table(kernel, elem_bytes, block_d))
            return (f"no configuration of the {KERNEL_TITLES[kernel]} kernel fits the shared memory of "
                    f"{target.name} ({target.smem:,} B per block): the smallest needs {need:,} B")
    return None


def _spilling(kernel: str, elem_bytes: int, block_d: int, constexprs: dict) -> frozenset:
    """The :data:`SPILLING` configurations of this launch's variant (never all of its table)."""
    variant = tuple(bool(constexprs.get(name)) for name in ("IS_VARLEN", "HAS_WINDOW", "IS_CAUSAL"))
    return SPILLING.get(_key(kernel, elem_bytes, block_d)[:3] + variant, frozenset())


def _key(kernel: str, elem_bytes: int, block_d: int, *config) -> tuple:
    """(kernel, "half" | "fp32", the table bound of ``block_d``, *config): the keys of
    :data:`SPILLING` and :data:`HOPPER_ONLY`."""
    width = "fp32" if elem_bytes == 4 else "half"
    bound = next(b for b in sorted(b for w, b in CONFIGS[kernel] if w == width) if b >= block_d)
    return (kernel, width, bound, *config)


def pruner(kernel: str):
    """``early_config_prune`` for ``triton.autotune``: keep the configurations of the table for the
    launch's dtype and BLOCK_D that fit the device of its first tensor argument, in the table's order
    (less what spills in this variant, :data:`SPILLING`)."""

    def prune(configs, named_args, **kwargs):
        q = next(iter(named_args.values()))
        elem, block_d = q.element_size(), kwargs["BLOCK_D"]
        target = device_target(q.device)
        skip = _spilling(kernel, elem, block_d, kwargs)
        order = [c for c in fitting(kernel, elem, block_d, target) if c not in skip]
        tiles = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        kept = [tiles[t] for t in order if t in tiles]  # in the table's order
        if not kept:  # the wrappers refuse such a case before launching; never launch what cannot fit
            raise ValueError(f"triton attention: {no_fit_reason([kernel], elem, block_d, target)}")
        return kept

    return prune
