"""One call that makes a transformers decoder ready for long-context training on a device mesh:
context-parallel attention, activation checkpointing, per-layer ``torch.compile`` and FSDP2.

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = parallelize(model, mesh, cp_method="zigzag_ring", checkpointing="layer", dtype=torch.bfloat16)
    model.to_empty(device="cuda")  # then fill the shards (a checkpoint, or an init)

Every parameter is sharded (FSDP2's ``fully_shard``) over all ``dp x cp`` ranks together: the
context-parallel ranks of a sequence hold the same weights, so they shard them too. Gradients are
*summed* over those ranks (FSDP's divide factor is 1), so the loss each rank back-propagates must be
its share of the global loss: ``this rank's token-loss sum / the global number of labels``
(``torch.distributed.all_reduce`` the label count first). The gradients are then the single-device
gradients of the whole batch's mean loss, whatever ``dp`` and ``cp`` are.

The context-parallel group (what :func:`~seqpar.integrations.hf.shard_inputs` needs, with the same
``cp_method``) is returned by :func:`context_parallel_group` and kept on the model as
``model.seqpar_cp_group``; for ``cp_method="usp"`` it is the Ulysses x ring pair built here, once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["CHECKPOINTING", "context_parallel_group", "parallelize"]

CHECKPOINTING = ("none", "layer", "attention")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HSDP_DIMS = ("dp_replicate", "dp_shard", "cp")


def _dim_names(mesh) -> tuple[str, ...]:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names or "cp" not in names:
        raise ValueError(f"mesh: expected a DeviceMesh with a dim named 'cp' (and 'dp', or 'dp_replicate' and "
                         f"'dp_shard' for HSDP), got dims {names or 'without names'}; build it with "
                         "init_device_mesh(device, (dp, cp), mesh_dim_names=('dp', 'cp'))")
    allowed = ({"dp", "cp"}, set(_HSDP_DIMS), {"cp"})
    if set(names) not in allowed or len(set(names)) != len(names):
        raise ValueError(f"mesh: dims {names} are not ('dp', 'cp'), ('cp',) or ('dp_replicate', 'dp_shard', 'cp'); "
                         "other parallel dims (tensor, pipeline) are not supported by parallelize")
    return names


def _ordered(mesh, order: tuple[str, ...]) -> torch.Tensor:
    """The mesh's global ranks with its dims permuted to ``order`` (names of the mesh, in any order)."""
    names = mesh.mesh_dim_names
    return mesh.mesh.permute(*[names.index(n) for n in order])


def _cp_blocks(mesh) -> list[list[int]]:
    """Every context-parallel group of the mesh as its global ranks (member order), the same list on every rank."""
    names = mesh.mesh_dim_names
    order = tuple(n for n in names if n != "cp") + ("cp",)
    return _ordered(mesh, order).reshape(-1, mesh.size(names.index("cp"))).tolist()


def _usp_pair(mesh, ulysses_degree: int | None):
    """USP's (Ulysses, ring) groups of this rank, built once for every cp group of ``mesh``.

    ``dist.new_group`` is collective over the whole job: every rank creates every subgroup of every
    context-parallel group, in the same order, and keeps its own two. Ulysses groups are blocks of
    ``U`` consecutive cp members, ring groups the members ``U`` apart (as ``make_usp_groups``)."""
    from ..comm.usp_groups import default_ulysses_degree, make_usp_groups

    blocks = _cp_blocks(mesh)
    n = len(blocks[0])
    u = default_ulysses_degree(n) if ulysses_degree is None else ulysses_degree
    if isinstance(u, bool) or not isinstance(u, int) or u < 1 or n % u:
        raise ValueError(f"ulysses_degree={ulysses_degree!r}: must divide the {n} context-parallel ranks")
    if len(blocks) == 1:  # the cp group is the whole mesh: make_usp_groups builds what it needs
        return make_usp_groups(mesh["cp"].get_group(), u)
    me = dist.get_rank()
    ulysses = ring = None
    for block in blocks:
        for j in range(n // u):
            pg = dist.new_group([block[j * u + i] for i in range(u)])
            ulysses = pg if me in block[j * u:(j + 1) * u] else ulysses
    for block in blocks:
        for i in range(u):
            members = [block[j * u + i] for j in range(n // u)]
            pg = dist.new_group(members)
            ring = pg if me in members else ring
    return make_usp_groups((ulysses, ring), u)


def context_parallel_group(mesh, cp_method: str = "zigzag_ring", ulysses_degree: int | None = None):
    """The ``group=`` for ``seqpar.attention`` / ``shard_inputs`` on ``mesh["cp"]``.

    ``mesh["cp"]`` (a 1-D DeviceMesh), or for ``cp_method="usp"`` the Ulysses x ring groups
    (``USPGroups``), built here: collective over the whole job when they need new groups, so every
    rank calls it at the same point, once (:func:`parallelize` calls it and keeps the result as
    ``model.seqpar_cp_group``). ``mesh=None``: a single device (not distributed).
    """
    if mesh is None:
        return None
    _dim_names(mesh)
    if cp_method == "usp":
        return _usp_pair(mesh, ulysses_degree)
    return mesh["cp"]


def _fsdp_mesh(mesh):
    """The mesh FSDP2 shards over: every ``dp x cp`` rank on one flattened dim, or for HSDP
    ``(dp_replicate, dp_shard x cp)`` (replicated across the first dim, sharded within the second)."""
    from torch.distributed.device_mesh import DeviceMesh

    names = mesh.mesh_dim_names
    if "dp_replicate" in names:
        ranks = _ordered(mesh, _HSDP_DIMS)
        ranks = ranks.reshape(ranks.shape[0], -1)
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    order = ("dp", "cp") if "dp" in names else ("cp",)
    return DeviceMesh(mesh.device_type, _ordered(mesh, order).reshape(-1), mesh_dim_names=("dp_cp",))


def _as_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        ok = dtype is None or dtype in _DTYPES.values()
    else:
        ok, dtype = dtype in _DTYPES, _DTYPES.get(dtype)
    if not ok:
        raise ValueError(f"dtype={dtype!r}: expected None (fp32 compute) or one of {', '.join(_DTYPES)}")
    return None if dtype == torch.float32 else dtype


def _check(model, mesh, cp_method, checkpointing, fsdp, dtype) -> None:
    from ..methods import method as declared

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    declared(cp_method, kind="softmax")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: choose one of {', '.join(CHECKPOINTING)}")
    if mesh is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("mesh: torch.distributed runs several ranks; pass the DeviceMesh with dims ('dp', 'cp')")
        if fsdp and dtype is not None:
            raise ValueError("dtype: mixed precision comes from FSDP2, which needs a mesh; pass a world-of-1 mesh "
                             "(init_device_mesh(device, (1, 1), mesh_dim_names=('dp', 'cp'))) or use torch.autocast")
        return
    _dim_names(mesh)
    if not fsdp and dtype is not None:
        raise ValueError("dtype: with fsdp=False the caller owns mixed precision (torch.autocast or its trainer's "
                         "setting); pass dtype=None")


def parallelize(model, mesh, *, cp_method: str = "zigzag_ring", checkpointing: str = "none", compile: bool = False,
                dtype=None, reshard_after_forward: bool = True, fsdp: bool = True, **attention_options):
    """Context-parallel attention, activation checkpointing, compile and FSDP2 on ``model``, in place.

    Args:
        model: a transformers decoder (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...), identical on
            every rank, on any device or on ``"meta"`` (then ``model.to_empty(device=...)`` and fill
            the shards afterwards; a model whose test forward cannot run on meta, such as gpt-oss,
            then needs :func:`seqpar.integrations.hf.verify_context_parallel` once filled).
        mesh: DeviceMesh with dims ``("dp", "cp")`` (a world of W = dp x cp ranks), ``("cp",)``, or
            ``("dp_replicate", "dp_shard", "cp")`` for HSDP; None on a single device without
            torch.distributed.
        cp_method: the softmax method over ``mesh["cp"]`` (``usp``: its groups are built once here).
        checkpointing: ``"none"``, ``"layer"`` (each decoder layer) or ``"attention"``
            (seqpar's rematerialisation-aware mode, :func:`seqpar.softmax.checkpoint.apply_checkpointing`).
        compile: ``torch.compile`` each decoder layer's forward (FSDP's hooks stay outside the graph).
        dtype: compute dtype (``torch.bfloat16``, ``"float16"``, ...): FSDP2's ``MixedPrecisionPolicy``
            casts parameters for compute and reduces gradients in float32; master weights and the
            optimizer state stay float32. None: float32 compute.
        reshard_after_forward: FSDP2's option (free unsharded layers after forward).
        fsdp: False skips sharding (a caller whose framework shards, e.g. accelerate).
        **attention_options: passed to every ``seqpar.attention`` call (``ulysses_degree``, ``backend``, ...).
    Returns:
        ``model`` (its decoder layers and the model itself are ``FSDPModule`` s when ``fsdp``). Its
        parameters are DTensors sharded on dim 0 over the ``dp x cp`` ranks; gradients are summed over
        them (back-propagate ``local token-loss sum / global label count``). ``model.seqpar_cp_group``
        is the group to shard inputs with. Collective: every rank calls it at the same point.
    Raises ``ValueError`` (before any communication) for a mesh without the dims above, an unknown
    method, checkpointing mode or dtype, and what :func:`apply_context_parallel` refuses.
    """
    from .hf.convert import _decoder_layers, apply_context_parallel

    dtype = _as_dtype(dtype)
    _check(model, mesh, cp_method, checkpointing, fsdp, dtype)
    ulysses_degree = attention_options.get("ulysses_degree")
    group = context_parallel_group(mesh, cp_method, ulysses_degree)
    apply_context_parallel(model, group=group, method=cp_method, **attention_options)
    model.seqpar_cp_group = group
    if checkpointing != "none":
        from ..softmax.checkpoint import apply_checkpointing

        apply_checkpointing(model, mode=checkpointing)
    _, layers = _decoder_layers(model)
    if compile:
        for layer in layers:  # the forward only: checkpointing and FSDP's hooks wrap it from outside
            layer.forward = torch.compile(layer.forward)
    if fsdp and mesh is not None:
        _shard(model, layers, _fsdp_mesh(mesh), dtype, reshard_after_forward)
    return model


def _shard(model, layers, fsdp_mesh, dtype, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    units = []
    for layer in layers:
        units.append(fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward,
                                 mp_policy=policy))
    units.append(fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy))
    for unit in units:
        # sums, not means: each rank's loss is already its share of the global mean, so the sum of the
        # ranks' gradients is the single-device gradient (a plain SUM also runs on gloo)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
