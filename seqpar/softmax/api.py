"""``seqpar.attention``: the public entry point for sequence-parallel softmax attention."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..comm import CommStats, GroupInfo, TokenRingGroups, group_info
from ..comm.agreement import (
    agreed,
    agreement_groups,
    check_ranks_enabled,
    check_same_on_ranks,
)
from ..comm.fingerprint import GRAD_FIELD, call_fields
from ..comm.usp_groups import describe_usp
from ..kernels import Band, available_backends, check_qkv, select_backend
from ..layouts import PackedLayout, StreamLayout, check_cu_seqlens, placement
from ..methods import Method, check_usp_options, check_window, names
from ..methods import method as declared
from ..tracing import Trace, begin, end, resolve
from .checkpoint import active_tape
from .compiled import compiled_attention
from .executor import RingAttention, RingConfig
from .lse import check_return_lse
from .packed import packed_schedule
from .registry import dense_plan
from .sinks import check_sinks
from .stream import stream_setup
from .ulysses import UlyssesAttention, ulysses_setup
from .usp import usp_setup
from .window import effective_window

_GRAD_COMM = {None: None, "fp32": torch.float32, "float32": torch.float32, "input": "input"}


def _validate(q, k, v, *, method, causal, softmax_scale, cu_seqlens, backend, grad_comm_dtype, info, window=None,
              ring_method=None, sinks=None, needs_grad=None):
    spec = declared(method, kind="softmax")
    check_window(spec, window, ring_method)
    check_qkv(q, k, v)
    check_sinks(sinks, q)
    if sinks is not None and not spec.sinks:
        raise ValueError(f"sinks: method={method!r} does not support attention sinks; use one of "
                         f"{', '.join(m for m in names('softmax') if declared(m).sinks)}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected True or False, got {causal!r}")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0
                                      or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: expected a positive finite number or None, got {softmax_scale!r}")
    if grad_comm_dtype not in _GRAD_COMM:
        raise ValueError(f"grad_comm_dtype: expected None, 'fp32' or 'input', got {grad_comm_dtype!r}")
    t_local = q.shape[1]
    if t_local < 1:
        raise ValueError("q: the local sequence is empty (T_local = 0)")
    if spec.layout_multiple > 1 and t_local % spec.layout_multiple:
        raise ValueError(
            f"q: method={method!r} uses the zigzag layout (two equal chunks per rank), but T_local={t_local} "
            f"is odd; shard a global sequence whose length is a multiple of 2N={2 * info.size} with seqpar.shard"
        )
    if backend is not None:
        if backend not in available_backends(include_unavailable=True):
            raise ValueError(f"backend={backend!r} is unknown; choose one of {', '.join(available_backends(True))}")
    # Resolve the kernel for the masks the plan uses, here on every rank, before any communication:
    # an unsupported case fails the same way everywhere instead of hanging the ring.
    masks = sorted({"none"} | ({"causal", "causal_strict"} if causal else set()))
    if window is not None:  # a band that cuts a block: native, or as plain pieces
        masks.append(Band(-1, 0) if causal else Band(-1, 1))
    for mask in masks:
        select_backend(q, k, v, mask=mask, backend=backend)
        if needs_grad if needs_grad is not None else (
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            select_backend(q, k, v, mask=mask, backend=backend, for_backward=True)
    return spec


def _check_same(host, method, group, ulysses_degree, q, trace) -> None:
    """The same cu_seqlens on every rank: a 3-number all-gather, recorded in ``trace`` (skipped for a
    prebuilt PackedLayout, and for usp given as a mesh or a pair of groups, which has no flat group)."""
    if method == "usp":
        flat = describe_usp(group, ulysses_degree).flat
        if flat is None or flat.single:
            return
        group = flat.group
    device = q.device if q.is_cuda else None  # NCCL groups need CUDA tensors
    check_same_on_ranks(host, group, device=device, trace=trace)


def _packed_setup(q, k, method, group, cu_seqlens, ulysses_degree, ring_method):
    """The PackedLayout of a packed call, validated against the local tensors (no communication)."""
    pl = placement(method, group, ulysses_degree=ulysses_degree, ring_method_name=ring_method).packed(cu_seqlens)
    t_local = pl.t_local // pl.align  # usp: a ring member's stream is cut into U pieces
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] != 1 or x.shape[1] != t_local:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}: with cu_seqlens a rank holds one packed stream "
                f"[1, {t_local}, H, D] (this batch's padded local length for method={method!r}); "
                f"shard the global [1, {pl.total_tokens}, H, D] with seqpar.shard(x, method={method!r}, "
                "cu_seqlens=cu_seqlens) and pass the same cu_seqlens here")
    return pl


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, method: str = "zigzag_ring",
              causal: bool = False, softmax_scale: float | None = None, cu_seqlens=None,
              backend: str | None = None, stats: CommStats | None = None,
              grad_comm_dtype: str | None = None, ulysses_degree: int | None = None,
              ring_method: str | None = None, check_ranks: bool | None = None,
              window: int | None = None, sinks: torch.Tensor | None = None,
              trace: Trace | None = None,
              return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over a sequence split across the ranks of ``group``.

    Shapes (N = ranks in ``group``, ``T_local = T_global / N``):
        q: ``[B, T_local, Hq, D]``; k: ``[B, T_local, Hkv, D]``; v: ``[B, T_local, Hkv, D_v]`` with
        ``Hq % Hkv == 0`` (GQA; K,V are never expanded to Hq heads, on the wire or in the kernels).
        ``D_v`` is usually ``D``; MLA models (DeepSeek-V2/V3: 192/128) use another, and the output,
        its accumulators and every message then carry ``D_v``. Each rank passes its own
        shard in the layout of ``method``: produce it with ``seqpar.shard(x, method=method)``.
    Returns:
        ``[B, T_local, Hq, D_v]`` in q's dtype: this rank's rows of the global attention output, in the
        same layout (``seqpar.unshard`` restores global order). Differentiable; gradients come back
        in the input dtypes. With ``return_lse=True``: ``(out, lse)``, lse ``[B, Hq, T_local]``.

    Args:
        group: ProcessGroup or 1-D DeviceMesh (None = the default group; a single device when
            torch.distributed is not initialised), or a ``TokenRingGroups`` (``token_ring`` and
            ``lightseq`` then send their two traffic directions on separate communicators).
        method: one of ``seqpar.METHODS``.
        causal: causal mask in *global* token order (query i sees keys j <= i).
        window: sliding window of ``W`` tokens in global order (within each document when packed):
            causal, query i sees keys ``i - W < j <= i`` (flash-attn's ``window_size=(W-1, 0)``,
            transformers' ``sliding_window=W``); non-causal, ``|i - j| < W`` (``(W-1, W-1)``). Every
            method serves it (``Method.window``); blocks, steps and transfers wholly outside the
            window are skipped (docs/methods.md gives the bytes against W). ``W >= T`` (or every
            document) is the same as None.
        softmax_scale: defaults to ``D ** -0.5``.
        cu_seqlens: packed variable-length input: global document offsets (int32, flash-attn
            convention, the same on every rank) of the packed stream, or a ``seqpar.packed_layout``
            built once for the batch (reused by every layer; ``split="stream"``: the stream cut in N
            contiguous pieces, documents crossing ranks, ``method="ring"``: :mod:`.stream`).
            Then q is ``[1, T_pad_local, Hq, D]``,
            the output of ``seqpar.shard(x, method=method, cu_seqlens=cu_seqlens)``; documents never
            attend across a boundary; padding rows get out 0 and no gradient.
        backend: force a block kernel (``seqpar.kernels.available_backends()``); default: the best
            that fits, chosen per block.
        stats: a ``seqpar.comm.CommStats`` that receives the bytes this rank sends (fwd and bwd).
        grad_comm_dtype: dtype of the dK,dV accumulators on the wire in backward: None/"fp32"
            (exact, default) or "input" (half the bytes for bf16/fp16, rounds partial sums).
        ulysses_degree, ring_method: ``method="usp"`` only (:mod:`seqpar.softmax.usp`): the
            Ulysses degree U when ``group`` is a plain group (default ``gcd(N, ranks per node)``;
            a 2-D mesh, a ``(ulysses_group, ring_group)`` pair or ``make_usp_groups(...)`` fix
            it) and the ring-family method across the ring axis (default ``"zigzag_ring"``).
            Pass the same ``group``/``ulysses_degree``/``ring_method`` to ``seqpar.shard``.
        check_ranks: check first, with ceil(log2 N) 56-byte messages per rank (on the CPU when the
            group takes CPU tensors), that every rank of the group passed the same arguments: every
            argument but ``stats`` (shapes, dtypes, method, causal, cu_seqlens, group members, every
            option; :mod:`seqpar.comm.agreement`). On a mismatch, or a ValueError on some ranks only,
            every rank raises a ValueError naming the disagreeing rank(s) and argument instead of
            hanging, aborting or returning a wrong result. None (default): on, unless the
            environment variable ``SEQPAR_CHECK_RANKS=0`` (read at each call). ``False`` skips it:
            then ranks that disagree may hang, have gloo abort their process, or return garbage.
        sinks: attention sinks (gpt-oss): a float32 ``[Hq]`` tensor, usually a parameter; head h's
            softmax denominator gets ``exp(sinks[h])`` with no value attached (:mod:`.sinks`).
            Every method; applied after the merge of all steps (no extra communication). Its
            gradient on each rank is that rank's share: sum it over the group (as for every
            parameter under context parallelism) for the gradient of the whole sequence.
        trace: a :class:`seqpar.Trace` that records this rank's kernels, messages and their
            dependencies, forward and backward (default: the enclosing ``with seqpar.trace(...)``
            block's, else none; :mod:`seqpar.tracing`).
        return_lse: also return ``lse [B, Hq, T_local]`` fp32 (float64 for float64), rows as out's: the log
            of each row's softmax denominator (scaled scores, sinks included; -inf for packed padding);
            differentiable (merges with other attention results); ulysses/usp send one more fp32 all-to-all
            for it, one more in backward (any rank's loss may hold it or not: :mod:`seqpar.softmax.lse`).

    Raises ``ValueError`` naming the argument, on every rank and before any communication, for bad
    shapes, dtypes, method, backend, window or lengths. Raises :class:`seqpar.PeerError` when a peer rank
    crashes or times out during the call.
    """
    arguments = dict(locals())  # every parameter: the rank agreement covers an option added later too
    if torch.compiler.is_compiling():  # torch.compile: the call is one opaque op (seqpar.softmax.compiled)
        return compiled_attention(q, k, v, arguments, _setup)
    return _attend(q, k, v, arguments)


def _attend(q, k, v, arguments: dict):
    """:func:`attention` once its arguments are captured: agreement (unless off), checks, runner.
    Returns ``out``, or ``(out, lse)`` for ``return_lse=True``."""
    trace = resolve(arguments["trace"])
    begin(trace, "attention fwd")
    function, args = _setup(q, k, v, arguments, trace=trace)
    result = function.apply(*args)
    end(trace, "attention fwd")
    return result


def _setup(q, k, v, arguments: dict, *, trace, first: bool = True, needs_grad: bool | None = None):
    """The family's autograd Function and its arguments ``(q, k, v, sinks, config)`` for one call.

    ``first``: the call's forward: the rank agreement (unless off) or the offsets check; False
    rebuilds the configuration of a call already checked (the compiled backward op). ``needs_grad``:
    whether backward will run (None: grad mode and the tensors say; the compiled op knows it from
    trace time)."""
    opts = {name: arguments[name] for name in ("group", "method", "causal", "softmax_scale", "cu_seqlens", "backend",
                                               "stats", "grad_comm_dtype", "ulysses_degree", "ring_method", "window",
                                               "sinks", "return_lse")}
    group, method = opts["group"], opts["method"]
    tape = active_tape()
    replaying = tape is not None and tape.replaying
    if not first or not check_ranks_enabled(arguments["check_ranks"]) or replaying:
        # (a checkpoint's recomputation replays a call whose arguments the forward checked; the tape
        # verifies that the shapes are the same)
        call = _prepare(q, k, v, same_offsets_check=first and not replaying, trace=trace, needs_grad=needs_grad,
                        **opts)
    else:
        # the fingerprint carries cu_seqlens: no separate offsets gather
        call = agreed(agreement_groups(group, usp=method == "usp", ulysses_degree=opts["ulysses_degree"]),
                      "seqpar.attention", _fingerprint(arguments, needs_grad),
                      lambda: _prepare(q, k, v, same_offsets_check=False, needs_grad=needs_grad, **opts),
                      device=q.device if isinstance(q, torch.Tensor) and q.is_cuda else None, trace=trace)
    function, config = FAMILIES[call.spec.family]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return function, (q, k, v, call.sinks, config(q, k, v, replace(call, trace=trace)))


def _prepare(q, k, v, *, group, method, causal, softmax_scale, cu_seqlens, backend, stats, grad_comm_dtype,
             ulysses_degree, ring_method, window, same_offsets_check: bool, sinks=None, trace=None,
             needs_grad=None, return_lse=False) -> "CallSpec":
    """Every local check of a call, and its CallSpec. Communicates only for ``same_offsets_check``
    (packed input: the cu_seqlens fingerprint all-gather of :func:`_check_same`, recorded in ``trace``)."""
    check_return_lse(return_lse)
    check_usp_options(method, ulysses_degree, ring_method)
    channels = None
    if isinstance(group, TokenRingGroups):  # the group plus one communicator per traffic direction
        group, channels = group.group, group.channels
    # usp takes a 2-D mesh, a pair of groups or USPGroups as group: its runner resolves them
    info = None if method == "usp" else group_info(group)
    packed = None
    if cu_seqlens is not None:
        # offsets checked locally, then (unless prebuilt) the same on every rank, then the local
        # tensors against them: every rank that reaches a ValueError reaches the same one
        check_window(declared(method, kind="softmax"), window, ring_method)
        check_qkv(q, k, v)
        check_sinks(sinks, q)  # before the offsets gather below
        if not isinstance(cu_seqlens, (PackedLayout, StreamLayout)):
            host = check_cu_seqlens(cu_seqlens, None)
            if same_offsets_check:
                _check_same(host, method, group, ulysses_degree, q, trace)
            cu_seqlens = host
        if isinstance(cu_seqlens, StreamLayout):  # contiguous pieces of the stream (seqpar.softmax.stream)
            packed = stream_setup(q, k, method, group, cu_seqlens)
        else:
            packed = _packed_setup(q, k, method, group, cu_seqlens, ulysses_degree, ring_method)
    spec = _validate(q, k, v, method=method, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                     backend=backend, grad_comm_dtype=grad_comm_dtype, info=info, window=window,
                     ring_method=ring_method, sinks=sinks, needs_grad=needs_grad)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    wire = _GRAD_COMM[grad_comm_dtype]
    if wire == "input":
        wire = k.dtype
    return CallSpec(info=info, spec=spec, causal=causal, scale=scale, backend=backend, grad_comm_dtype=wire,
                    stats=stats, group=group, ulysses_degree=ulysses_degree, ring_method=ring_method,
                    channels=channels, packed=packed, window=window, sinks=sinks, return_lse=return_lse)


def _fingerprint(arguments: dict, needs_grad: bool | None = None) -> dict[str, str]:
    """What every rank of the group must pass identically: every argument (shapes are per rank, so
    T_local agrees too), and for usp the arrangement resolved from group and ulysses_degree (its
    default comes from each rank's LOCAL_WORLD_SIZE)."""
    derived = {}
    if arguments["method"] == "usp":
        try:
            axes = describe_usp(arguments["group"], arguments["ulysses_degree"])
            derived["usp arrangement (ulysses x ring)"] = f"{axes.ulysses_degree} x {axes.ring_degree}"
        except Exception as exc:  # noqa: BLE001 - the local checks report it; the fingerprint never fails
            derived["usp arrangement (ulysses x ring)"] = f"invalid ({exc})"
    fields = call_fields(arguments, derived)
    if needs_grad is not None:  # the compiled op: its tensors never require grad, trace time said
        fields[GRAD_FIELD] = repr(needs_grad)
    return fields


@dataclass(frozen=True)
class CallSpec:
    """One validated call, as handed to a family's runner."""

    info: GroupInfo
    spec: Method
    causal: bool
    scale: float
    backend: str | None
    grad_comm_dtype: torch.dtype | None
    stats: CommStats | None
    group: object = None  # the caller's group argument (usp resolves its two axes from it)
    ulysses_degree: int | None = None
    ring_method: str | None = None
    channels: tuple | None = None  # extra communicators of a TokenRingGroups (one per traffic direction)
    packed: PackedLayout | None = None  # packed input: geometry built once (schedules cached on it)
    window: int | None = None  # sliding window as given (runners drop one that covers everything)
    sinks: torch.Tensor | None = None  # [Hq] float32 attention sinks (seqpar.softmax.sinks), or None
    trace: Trace | None = None  # records this call (seqpar.tracing)
    return_lse: bool = False  # the family's Function returns (out, lse) (seqpar.softmax.lse)


def _ring_config(q, k, v, call: CallSpec) -> RingConfig:
    window = effective_window(call.window, call.packed, call.info.size * q.shape[1])
    if call.packed is not None:
        plan = packed_schedule(call.spec, call.packed, call.info.rank, call.causal, window)
    else:
        plan = dense_plan(call.spec, call.info.rank, call.info.size, q.shape[1], call.causal, window)
    return RingConfig(info=call.info, plan=plan, scale=call.scale, backend=call.backend,
                      grad_comm_dtype=call.grad_comm_dtype, stats=call.stats, channels=call.channels, trace=call.trace,
                      return_lse=call.return_lse)


# family name -> (autograd Function, its config builder (q, k, v, CallSpec) -> config); the Function
# takes (q, k, v, sinks, config). A new family adds its module and one entry here (and its saved
# tensors' shapes to seqpar.softmax.compiled).
FAMILIES = {"ring": (RingAttention, _ring_config), "ulysses": (UlyssesAttention, ulysses_setup),
            "usp": (UlyssesAttention, usp_setup)}


class SequenceParallelAttention(torch.nn.Module):
    """Module form of :func:`attention`: holds the group and options, takes ``(q, k, v)``.

    ``forward(q [B, T_local, Hq, D], k, v [B, T_local, Hkv, D], cu_seqlens=None, stats=None, sinks=None,
    return_lse=False) -> [B, T_local, Hq, D]`` (``sinks``: the layer's ``[Hq]`` parameter, owned by the
    caller; ``return_lse=True``: ``(out, lse [B, Hq, T_local])`` as :func:`attention` returns them).
    ``check_ranks`` as in :func:`attention` (None: on, unless ``SEQPAR_CHECK_RANKS=0``).
    """

    def __init__(self, *, group=None, method: str = "zigzag_ring", causal: bool = False,
                 softmax_scale: float | None = None, backend: str | None = None,
                 ulysses_degree: int | None = None, ring_method: str | None = None,
                 check_ranks: bool | None = None, window: int | None = None):
        super().__init__()
        check_window(declared(method, kind="softmax"), window, ring_method)
        check_usp_options(method, ulysses_degree, ring_method)
        self.group, self.method, self.causal = group, method, causal
        self.softmax_scale, self.backend = softmax_scale, backend
        self.ulysses_degree, self.ring_method = ulysses_degree, ring_method
        self.check_ranks, self.window = check_ranks, window

    def forward(self, q, k, v, cu_seqlens=None, stats: CommStats | None = None, sinks=None, return_lse: bool = False):
        return attention(q, k, v, group=self.group, method=self.method, causal=self.causal,
                         softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens, backend=self.backend,
                         stats=stats, ulysses_degree=self.ulysses_degree, ring_method=self.ring_method,
                         check_ranks=self.check_ranks, window=self.window, sinks=sinks, return_lse=return_lse)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, causal={self.causal}" + (f", window={self.window}" if self.window else "")
