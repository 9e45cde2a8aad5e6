"""Cost model of one training step of a sequence-parallel group (seqpar/schedulers/README.md).

A group of ``d`` ranks runs a packed batch of sequences ``S`` with one method. With
``S1 = Σ s`` and ``S2 = Σ s²`` its step time (forward + backward, all layers) is

    time = const + lin·S1 + max(quad·S2, overlap·S1)          (0 for an empty group)

where ``quad·S2 = α1·S2/d`` is the attention compute (the only part communication can hide behind),
``lin = α2/d + (communication that is not overlapped, per token)``, ``overlap`` is the communication
per token that runs under the attention compute (ring family, TokenRing, LightSeq, the ring axis of
USP) and ``const = β1 + latencies (+ ZeCO's one state)``. Memory per rank is
``M_model + S1·(M_token/d + M_token_full·[d > 1])``. A group of one rank communicates nothing.

Every formula is linear in (S1, S2) inside the max, so the MILP of :mod:`.milp` can use it exactly;
:class:`GroupCoeffs` is that common form and the single source of truth for times and memory.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Iterable, Sequence

from ..methods import BY_PREFERENCE
from ..methods import method as declared
from .cluster import ClusterSpec, _lookup, _size_table, check_file_keys, is_power_of_two
from .cost_comm import comm_parts, method_buffers
from .replay_table import attention_factor

#: every method the cost model knows, in the planner's order of preference (seqpar.methods)
KNOWN_METHODS = BY_PREFERENCE
SOFTMAX_METHODS = tuple(n for n in KNOWN_METHODS if declared(n).softmax)
LINEAR_METHODS = tuple(n for n in KNOWN_METHODS if not declared(n).softmax)
_REQUIRED_COEFFS = ("alpha1", "alpha2", "beta1", "m_token", "m_model")

# Default GPU numbers (H100 SXM, bf16), used by CostModel.default():
#   attention: 400e12 FLOP/s effective for flash attention fwd+bwd (FA2/FA3 reach 350-600 TFLOP/s on
#     H100 at long lengths; 400 is a conservative middle). FLOPs per layer: 4·s²·hidden (QKᵀ and PV),
#     ×0.5 causal, ×3.5 forward+backward (backward ≈ 2.5× forward), +1 forward when recomputed.
#   linear part: 6·P FLOPs per token (forward+backward of every weight; 8·P with recompute) at
#     450e12 FLOP/s (≈45% of the 989 TFLOP/s dense bf16 peak, a typical MFU for 8B-class training).
#   beta1: 1 ms per group step for launches and varlen metadata (≈ 30 µs per layer).
#   memory: M_model 12e9 bytes (sharded optimizer states, one gathered layer, CUDA context and
#     workspace); M_token = bf16 layer inputs kept by layer-boundary checkpointing (2·hidden·layers
#     bytes) + one layer's recompute working set (~36·hidden bytes) ≈ 410 KB/token for Llama-3-8B.
GPU_ATTENTION_FLOPS = 400e12
GPU_GEMM_FLOPS = 450e12
GPU_BETA1 = 1e-3
GPU_M_MODEL = 12e9


@dataclass(frozen=True)
class MethodCost:
    """Per-method coefficients (one rank doing all the work; the group divides it by ``d``).

    alpha1: seconds per token² (attention compute, fwd+bwd, all layers).
    alpha2: seconds per token (everything linear in the length, fwd+bwd, all layers).
    beta1: seconds of constant overhead per group and step.
    m_token: bytes per token a rank holds for its share of the tokens (divided over the group).
    m_model: bytes per rank independent of the tokens (weights, optimizer states, workspace).
    m_token_full: bytes per token of the whole group's batch every rank of a group of d > 1 holds
        (e.g. the gathered K,V of all-gather KV); not divided by d.
    comm_scale: multiplies the modelled communication time (a calibration knob; 1 = the formula).
    group_scale: ``((d, k_attn, k_rest), ...)``: measured corrections of this method on groups of d
        ranks on the calibrated machine (``seqpar calibrate`` times real packed steps of every group
        size and fits ``measured = k_attn·A + k_rest·R`` over them, :func:`.calibrate.fit_group_scale`):
        ``k_attn`` multiplies the attention part ``A = max(quad·S2, overlap·S1)`` of
        :meth:`CostModel.group_coeffs` (compute and the communication hidden under it), ``k_rest`` the
        rest ``R = const + lin·S1`` (linear work, exposed communication, latencies). A size not in
        the table takes the nearest measured one below it (else above). Empty (the default): the
        formula alone. Tied to the machine it was measured on: projections elsewhere drop it.
    kernel_scale: ``((d, factor), ...)``: the method's attention kernels on groups of d ranks take
        ``factor`` times the work its schedule should (emulated on one device by ``seqpar calibrate``:
        e.g. striped_ring's strided causal blocks run dense on the CPU path, ~1.5x). Multiplies the
        attention term; looked up like ``group_scale``; dropped for other hardware.
    """

    alpha1: float
    alpha2: float
    beta1: float
    m_token: float
    m_model: float
    m_token_full: float = 0.0
    comm_scale: float = 1.0
    group_scale: tuple[tuple[int, float, float], ...] = ()
    kernel_scale: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_scale", _size_table("group_scale", self.group_scale, 2))
        object.__setattr__(self, "kernel_scale", _size_table("kernel_scale", self.kernel_scale, 1))
        for f in fields(self):
            if f.name in ("group_scale", "kernel_scale"):
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"{f.name}: expected a non-negative finite number, got {value!r}")

    def scale(self, group_size: int) -> tuple[float, float]:
        """``(k_attn, k_rest)`` of :attr:`group_scale` for ``group_size`` ((1, 1) when none was measured)."""
        return _lookup(self.group_scale, group_size, (1.0, 1.0))

    def kernel(self, group_size: int) -> float:
        """The :attr:`kernel_scale` factor for ``group_size`` (1 on one rank or when none was measured)."""
        return 1.0 if group_size == 1 else _lookup(self.kernel_scale, group_size, (1.0,))[0]


@dataclass(frozen=True)
class GroupCoeffs:
    """Time and memory of one (method, group size) as linear forms of S1 = Σs and S2 = Σs²."""

    const: float
    lin: float
    quad: float
    overlap: float
    mem_const: float
    mem_lin: float

    def time(self, s1: float, s2: float) -> float:
        """Step time in seconds of a group whose sequences sum to s1 tokens and s2 tokens²."""
        return sum(self.parts(s1, s2))

    def parts(self, s1: float, s2: float) -> tuple[float, float]:
        """``(A, R)``: the attention part ``max(quad·s2, overlap·s1)`` and the rest ``const + lin·s1``."""
        if s1 <= 0:
            return 0.0, 0.0
        return max(self.quad * s2, self.overlap * s1), self.const + self.lin * s1

    def memory(self, s1: float) -> float:
        """Peak bytes per rank for s1 tokens in the group."""
        return self.mem_const + self.mem_lin * s1

    def dominates(self, other: "GroupCoeffs") -> bool:
        """True when this is never slower nor heavier than ``other``, for every batch."""
        return (self.const <= other.const and self.quad <= other.quad and self.lin <= other.lin
                and self.lin + self.overlap <= other.lin + other.overlap
                and self.mem_const <= other.mem_const and self.mem_lin <= other.mem_lin)


@dataclass(frozen=True)
class CostModel:
    """Step-time and memory model of sequence-parallel attention methods for one transformer.

    methods: ``((name, MethodCost), ...)`` in order of preference (ties go to the earlier one).
    hidden: d = Hq·D; kv_hidden: d_kv = Hkv·D; layers; n_heads: Hq (Ulysses needs Hq >= group size);
    bytes_per_element: of activations on the wire (2 for bf16).
    grad_bytes_per_element: of the gradient accumulators that travel in backward (ring dK,dV,
        TokenRing dq, all-gather KV's reduce-scatter). Default: ``bytes_per_element``, i.e.
        ``grad_comm_dtype="input"`` (what bf16 training on GPUs uses); seqpar's own default sends
        them in fp32: 4 (``seqpar calibrate`` records what it measured with).
    """

    methods: tuple[tuple[str, MethodCost], ...]
    hidden: int = 4096
    kv_hidden: int = 1024
    layers: int = 32
    n_heads: int = 32
    bytes_per_element: int = 2
    grad_bytes_per_element: int | None = None

    def __post_init__(self) -> None:
        if self.grad_bytes_per_element is None:
            object.__setattr__(self, "grad_bytes_per_element", self.bytes_per_element)
        for name in ("hidden", "kv_hidden", "layers", "n_heads", "bytes_per_element", "grad_bytes_per_element"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.hidden % self.n_heads or self.kv_hidden % (self.hidden // self.n_heads):
            raise ValueError(f"hidden={self.hidden}, kv_hidden={self.kv_hidden}, n_heads={self.n_heads}: hidden "
                             f"must be n_heads·head_dim and kv_hidden a multiple of head_dim")
        object.__setattr__(self, "methods", tuple((str(n), c) for n, c in self.methods))
        names = [n for n, _ in self.methods]
        if not names:
            raise ValueError("methods: a cost model needs at least one method")
        for name, coeffs in self.methods:
            if name not in KNOWN_METHODS:
                raise ValueError(f"methods: unknown method {name!r}; known: {', '.join(KNOWN_METHODS)}")
            if not isinstance(coeffs, MethodCost):
                raise ValueError(f"methods: coefficients of {name!r} must be a MethodCost")
        if len(set(names)) != len(names):
            raise ValueError(f"methods: duplicate names in {names}")

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def default(cls, hidden: int = 4096, kv_hidden: int = 1024, layers: int = 32, n_heads: int = 32,
                ffn: int = 14336, vocab: int = 128256, attention_flops: float = GPU_ATTENTION_FLOPS,
                gemm_flops: float = GPU_GEMM_FLOPS, methods: Iterable[str] = KNOWN_METHODS,
                checkpointing: str = "layer") -> "CostModel":
        """Coefficients for H100-class GPUs, derived from FLOP counts (defaults: Llama-3-8B shape).

        alpha1 = 4·hidden·0.5 (causal)·passes·layers / attention_flops;
        alpha2 = 2·passes·P / gemm_flops with P = layers·(2·hidden² + 2·hidden·kv_hidden + 3·hidden·ffn)
        + vocab·hidden, where ``passes`` is 3.5 for attention (backward ≈ 2.5× forward) and 3 for the
        weights (backward = 2× forward), each +1 forward when activations are recomputed.
        Linear-attention methods (zeco, lasp2, lasp1) get alpha1 = 0 and the chunked (chunk 64) linear
        attention FLOPs, ~(2·64 + 4·head_dim)·hidden per token and layer × passes, at half the rate.

        checkpointing: ``"layer"`` (the default; what long-context training uses): only each decoder
            layer's bf16 input is kept (2·hidden·layers bytes per token) plus one layer's recompute
            working set (~36·hidden), ≈ 410 KB/token for Llama-3-8B, and backward recomputes the
            forward. ``"none"``: every activation a Llama block saves is kept — per layer and token the
            two RMSNorms' inputs and outputs (4·h), the q/k/v projection input (h), q after RoPE and
            k, v (h + 2·h_kv), the attention output (h), the MLP input (h) and gate, up, silu(gate)
            and their product (4·ffn) in bf16: 2·(8·h + 2·h_kv + 4·ffn) bytes (5.9 MB/token over 32
            layers of Llama-3-8B; cf. 34·h per GPT block in Korthikanti et al. 2022) — no recompute.
        """
        if checkpointing not in ("layer", "none"):
            raise ValueError(f"checkpointing: expected 'layer' or 'none', got {checkpointing!r}")
        e = 2
        recompute = 1 if checkpointing == "layer" else 0
        params = layers * (2 * hidden * hidden + 2 * hidden * kv_hidden + 3 * hidden * ffn) + vocab * hidden
        attn_passes = 3.5 + recompute
        alpha1 = 4 * hidden * 0.5 * attn_passes * layers / attention_flops
        alpha2 = 2 * (3 + recompute) * params / gemm_flops
        head_dim = hidden // n_heads
        if checkpointing == "layer":
            m_token = e * hidden * layers + 36 * hidden
        else:
            m_token = e * (8 * hidden + 2 * kv_hidden + 4 * ffn) * layers
        linear_attn = (2 * 64 + 4 * head_dim) * hidden * attn_passes * layers / (attention_flops / 2)
        out = []
        for name in methods:
            if name not in KNOWN_METHODS:
                raise ValueError(f"methods: unknown method {name!r}; known: {', '.join(KNOWN_METHODS)}")
            tok, full = method_buffers(name, hidden, kv_hidden, n_heads, e)
            linear = name in LINEAR_METHODS
            out.append((name, MethodCost(alpha1=0.0 if linear else alpha1,
                                         alpha2=alpha2 + (linear_attn if linear else 0.0),
                                         beta1=GPU_BETA1, m_token=m_token + tok, m_model=GPU_M_MODEL,
                                         m_token_full=full)))
        return cls(methods=tuple(out), hidden=hidden, kv_hidden=kv_hidden, layers=layers, n_heads=n_heads)

    # ----------------------------------------------------------------------------- lookup
    @property
    def method_names(self) -> tuple[str, ...]:
        """Names of the methods this model knows, in preference order."""
        return tuple(n for n, _ in self.methods)

    def coeffs(self, method: str) -> MethodCost:
        """The :class:`MethodCost` of ``method`` (ValueError naming it when the model lacks it)."""
        for name, c in self.methods:
            if name == method:
                return c
        raise ValueError(f"method={method!r} is not in this cost model; it has {', '.join(self.method_names)}")

    def supports(self, method: str, group_size: int) -> bool:
        """Whether ``method`` can run on a group of this size (Ulysses needs n_heads >= size)."""
        self.coeffs(method)
        return not (declared(method).family == "ulysses" and self.n_heads < group_size)

    def default_methods(self) -> tuple[str, ...]:
        """Methods a plan may use by default: the softmax ones (or the linear ones when only those)."""
        soft = tuple(n for n in self.method_names if n not in LINEAR_METHODS)
        return soft or self.method_names

    # ----------------------------------------------------------------------------- model
    def group_coeffs(self, method: str, group_size: int, cluster: ClusterSpec,
                     active_ranks: int | None = None) -> GroupCoeffs:
        """Time and memory coefficients of ``method`` on an aligned group of ``group_size`` ranks.

        Compute is :meth:`compute_coeffs` at ``cluster.compute_slowdown(active_ranks)`` (ranks sharing
        cores, default all; 1 on GPUs). Of the communication a method overlaps, the fraction
        ``cluster.overlap_factor`` hides under the attention compute and the rest adds up;
        :attr:`MethodCost.group_scale` multiplies ``overlap`` by its k_attn, communication in ``const``
        and ``lin`` by its k_rest. Raises ValueError when the method cannot run at this size.
        """
        c = self.coeffs(method)
        d = group_size
        if not is_power_of_two(d) or d > cluster.world_size:
            raise ValueError(f"group_size={d!r} must be a power of two no larger than {cluster.world_size}")
        if not self.supports(method, d):
            raise ValueError(f"group_size={d}: ulysses needs at least one of n_heads={self.n_heads} per rank; "
                             f"use usp (Ulysses inside a node, ring across) for larger groups")
        lin_comm, overlap, const_comm = self._comm_terms(method, d, cluster)
        s, o = c.comm_scale, cluster.overlap_factor
        ka, kr = c.scale(d)
        slow = cluster.compute_slowdown(active_ranks)
        const, lin, quad = self.compute_coeffs(method, d, slow, cluster.ranks_per_node)
        return GroupCoeffs(const=const + kr * s * const_comm, lin=lin + kr * s * (lin_comm + (1 - o) * overlap),
                           quad=quad,
                           overlap=ka * s * o * overlap,
                           mem_const=c.m_model, mem_lin=c.m_token / d + (c.m_token_full if d > 1 else 0.0))

    def compute_coeffs(self, method: str, group_size: int, slowdown: float = 1.0,
                       ranks_per_node: int | None = None) -> tuple[float, float, float]:
        """``(const, lin, quad)`` of one rank's compute in a group (no communication): β1, α2/d and
        α1·:func:`attention_factor`/d (head imbalance of usp at ``ranks_per_node``) times ``slowdown``,
        with the k_rest / k_attn of :attr:`MethodCost.group_scale` and :attr:`MethodCost.kernel_scale`."""
        c, d = self.coeffs(method), group_size
        ka, kr = c.scale(d)
        return (kr * slowdown * c.beta1, kr * slowdown * c.alpha2 / d,
                ka * c.kernel(d) * c.alpha1 * attention_factor(method, d, slowdown, self.n_heads, ranks_per_node) / d)

    def comm_parts(self, method: str, d: int, cluster: ClusterSpec) -> tuple[list[tuple], float]:
        """Communication of one step per rank of a group of ``d``: see :func:`.cost_comm.comm_parts`."""
        return comm_parts(self, method, d, cluster)

    def comm_bytes(self, method: str, group_size: int, tokens: float, cluster: ClusterSpec) -> float:
        """Bytes one rank sends (all-gather: receives) in one step of a group holding ``tokens`` in all."""
        parts, _ = self.comm_parts(method, group_size, cluster)
        return sum(per_tok * tokens + const for per_tok, const, *_ in parts)

    def _comm_terms(self, method: str, d: int, cluster: ClusterSpec) -> tuple[float, float, float]:
        """(seconds per token not overlapped, seconds per token overlapped, constant seconds), all layers."""
        parts, const = self.comm_parts(method, d, cluster)
        lin = over = 0.0
        for per_tok, const_bytes, overlapped, size, kind in parts:
            bw = cluster.bandwidth(size, kind)
            const += const_bytes / bw
            if overlapped:
                over += per_tok / bw
            else:
                lin += per_tok / bw
        return lin, over, const

    def time(self, method: str, group_size: int, seq_lens: Sequence[int], cluster: ClusterSpec) -> float:
        """Modelled step time (seconds, fwd+bwd, all layers) of a group running ``seq_lens`` packed."""
        lens = _check_lens(seq_lens, allow_empty=True)
        return self.group_coeffs(method, group_size, cluster).time(sum(lens), sum(s * s for s in lens))

    def memory(self, method: str, group_size: int, seq_lens: Sequence[int]) -> float:
        """Modelled peak bytes per rank of a group of ``group_size`` ranks running ``seq_lens``."""
        lens = _check_lens(seq_lens, allow_empty=True)
        c = self.coeffs(method)
        if not is_power_of_two(group_size):
            raise ValueError(f"group_size={group_size!r} must be a power of two")
        per_token = c.m_token / group_size + (c.m_token_full if group_size > 1 else 0.0)
        return c.m_model + per_token * sum(lens)

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """JSON-friendly dict: ``{"format", "version", "model": {...}, "methods": {name: {...}}}``."""
        return {"format": "seqpar-cost-model", "version": 1,
                "model": {"hidden": self.hidden, "kv_hidden": self.kv_hidden, "layers": self.layers,
                          "n_heads": self.n_heads, "bytes_per_element": self.bytes_per_element,
                          "grad_bytes_per_element": self.grad_bytes_per_element},
                "methods": {n: asdict(c) for n, c in self.methods}}

    def to_json(self) -> str:
        """The model as JSON text (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Write the model as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "cost model",
                  required: Iterable[str] = ()) -> "CostModel":
        """Build from :meth:`to_dict` output (or a ``seqpar calibrate`` file, whose ``cost_model`` part is
        used); ValueError naming ``source`` and the faulty method/key."""
        if isinstance(data, dict) and data.get("format") == "seqpar-calibration" and "cost_model" in data:
            data = data["cost_model"]
        if not isinstance(data, dict) or not isinstance(data.get("methods"), dict):
            raise ValueError(f"{source}: expected an object with a 'methods' object")
        check_file_keys(data, ("format", "version", "model", "methods"), source)
        model = data.get("model", {})
        if not isinstance(model, dict):
            raise ValueError(f"{source}: 'model' must be an object")
        for name in required:
            if name not in data["methods"]:
                raise ValueError(f"{source}: method {name!r} is missing (the file has "
                                 f"{', '.join(data['methods']) or 'no methods'})")
        methods = []
        for name, raw in data["methods"].items():
            if not isinstance(raw, dict):
                raise ValueError(f"{source}: method {name!r}: expected an object of coefficients")
            missing = [k for k in _REQUIRED_COEFFS if k not in raw]
            unknown = sorted(set(raw) - {f.name for f in fields(MethodCost)})
            if missing or unknown:
                raise ValueError(f"{source}: method {name!r}: missing {missing} / unknown {unknown} coefficients")
            for table in ("group_scale", "kernel_scale"):
                if isinstance(raw.get(table), list):
                    raw = dict(raw, **{table: tuple(tuple(e) if isinstance(e, list) else e for e in raw[table])})
            try:
                methods.append((name, MethodCost(**raw)))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: method {name!r}: {exc}") from None
        try:
            return cls(methods=tuple(methods), **model)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "cost model", required: Iterable[str] = ()) -> "CostModel":
        """Parse :meth:`to_json` text; ValueError naming ``source`` when it is not a usable model."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=source, required=required)

    @classmethod
    def load(cls, path: str | Path, *, required: Iterable[str] = ()) -> "CostModel":
        """Read a JSON cost model; ValueError naming the file (and the method) when it is unusable."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cost model file {str(path)!r}: cannot be read ({exc})") from None
        return cls.from_json(text, source=f"cost model file {str(path)!r}", required=required)

    def with_group_scales(self, scales: dict) -> "CostModel":
        """A copy whose methods get ``scales[method] = {group size: (k_attn, k_rest)}`` (``group_scale``);
        ``{}`` for a method (or ``without_group_scales``) removes its table."""
        return self._with_tables("group_scale", {n: [(d, *k) for d, k in by.items()] for n, by in scales.items()})

    def with_kernel_scales(self, scales: dict) -> "CostModel":
        """A copy whose methods get ``scales[method] = {group size: factor}`` (``kernel_scale``)."""
        return self._with_tables("kernel_scale", {n: list(by.items()) for n, by in scales.items()})

    def _with_tables(self, name: str, tables: dict) -> "CostModel":
        """A copy whose methods in ``tables`` get ``tables[method]`` as their ``name`` table."""
        return replace(self, methods=tuple((n, replace(c, **{name: tuple(tables[n])}) if n in tables else c)
                                           for n, c in self.methods))

    def for_other_hardware(self) -> "CostModel":
        """A copy without the factors measured on the calibrated machine (group and kernel scales)."""
        return self.without_group_scales().with_kernel_scales({n: {} for n in self.method_names})

    def without_group_scales(self) -> "CostModel":
        """A copy with no measured group factors (for projecting to hardware other than the calibrated)."""
        return self.with_group_scales({n: {} for n in self.method_names})

    def with_methods(self, names: Iterable[str]) -> "CostModel":
        """A copy restricted to ``names`` (in that order)."""
        return replace(self, methods=tuple((n, self.coeffs(n)) for n in names))


def _check_lens(seq_lens: Sequence[int], *, allow_empty: bool = False, argument: str = "seq_lens") -> list[int]:
    """Validate sequence lengths (positive integers); ValueError naming ``argument``."""
    if isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__iter__"):
        raise ValueError(f"{argument}: expected a sequence of positive integers, got {type(seq_lens).__name__}")
    raw = list(seq_lens)
    def whole(s) -> bool:  # NaN and infinities are Real but not whole numbers of tokens
        return (not isinstance(s, bool) and isinstance(s, numbers.Real) and math.isfinite(s) and s == int(s))

    if not all(whole(s) for s in raw):
        bad = next(s for s in raw if not whole(s))
        raise ValueError(f"{argument}: lengths must be whole numbers of tokens, got {bad!r}")
    lens = [int(s) for s in raw]
    if not lens and not allow_empty:
        raise ValueError(f"{argument}: the batch is empty; pass at least one sequence length")
    bad = [(i, s) for i, s in enumerate(lens) if s <= 0]
    if bad:
        i, s = bad[0]
        raise ValueError(f"{argument}: lengths must be positive, but seq_lens[{i}] = {s} "
                         f"({len(bad)} non-positive in all); drop empty sequences before planning")
    return lens
