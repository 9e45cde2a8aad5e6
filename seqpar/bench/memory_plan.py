"""The memory plan: each rank's peak memory for one training step (``seqpar memory``).

Torch-free arithmetic over the model's shape and the run's setup. The step is the one
:func:`seqpar.integrations.parallelize.parallelize` builds: context-parallel attention over ``cp``
ranks, activation checkpointing (``"none"`` | ``"layer"`` | ``"attention"``), FSDP2 ``fully_shard``
on every decoder layer and the root over all ``dp x cp`` ranks (S = dp·cp shards), mixed precision
by ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``, AdamW.

Bytes held between steps (static): the fp32 parameter shards (with mixed precision these *are* the
fp32 master weights: FSDP2 keeps the sharded parameter in fp32 and all-gathers a compute-dtype copy)
``4·P/S`` and AdamW's fp32 ``exp_avg`` and ``exp_avg_sq`` ``8·P/S``. The fp32 gradient shards
``4·P/S`` grow during backward and are freed by ``zero_grad(set_to_none=True)``.

The step is walked as a sequence of moments (:func:`moments`: the last layer's forward, the loss's
forward and backward, the final norm's backward, each layer's MLP and attention backward (and its
recomputation), the optimizer step), each the sum of what is live then; the peak is the largest. Per local token (T = micro_batch·seq/cp tokens on a rank; e bytes per
element of the compute dtype; h hidden size, h_q = Hq·D, h_kv = Hkv·D, I the MLP width, V the
vocabulary), what a Llama decoder layer saves for backward (transformers' LlamaDecoderLayer):

- each RMSNorm: its fp32 input ``4h``, the normalised ``e·h`` (cast back), its output ``e·h``
  (saved by the projections after it), ``4`` for the rsqrt: ``(4 + 2e)·h + 4``;
- attention: rotary q ``e·h_q``, k and v ``2e·h_kv``, out ``e·h_q`` (the same tensor o_proj saves),
  lse ``4·Hq`` (fp32); Ulysses/USP save the head-sharded q, k, v, out and lse instead of q, k, v;
- MLP: gate, SiLU(gate), up and their product: ``4e·I``.

Checkpointing keeps per layer only its input ``e·h`` (``"layer"``), plus the attention's out and
lse (``"attention"``: the recomputation replays them), and recomputes one layer at a time in
backward. The methods' own buffers (K,V ring double buffers, all-gathered K,V, Ulysses head shards,
fp32 out/lse and dK/dV accumulators) are live only inside one layer's attention: see
:func:`attention_buffers`. The loss is either chunks of ``loss_chunk`` tokens (the default, as
:func:`seqpar.integrations.loss.causal_lm_loss` computes it) or the full ``[T, V]`` logits
(``loss_chunk=0``: the compute-dtype logits, their fp32 copy, log-softmax and its gradients); see
:func:`loss_terms`. FSDP2 holds the root's gathered parameters (embeddings, final norm,
head) from forward to the end of backward, one or two gathered layers (the current and the
prefetched one), and per layer in backward its compute-dtype gradients and the fp32 reduce-scatter
input.

What is not counted: the CUDA context, NCCL's own buffers, allocator fragmentation and kernel
workspaces outside torch's allocator (the fit leaves ``headroom`` for them, :mod:`.memory_search`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..methods import method as declared

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHECKPOINTING = ("none", "layer", "attention")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (a Llama-style model: RMSNorm, rotary attention with GQA, SwiGLU MLP)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model") -> "ModelShape":
        """From a transformers ``config.json`` dict (``hidden_size``, ``intermediate_size``, ...)."""
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"model: the config lacks {', '.join(missing)}; pass a decoder's config.json "
                             "(Llama, Qwen2, Mistral) or a known name")
        heads = int(cfg["num_attention_heads"])
        return cls(name=str(cfg.get("_name_or_path") or name), hidden=int(cfg["hidden_size"]),
                   intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def h_q(self) -> int:
        return self.heads * self.head_dim

    @property
    def h_kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, gate/up/down, two norms."""
        h = self.hidden
        return h * self.h_q * 2 + 2 * h * self.h_kv + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class Setup:
    """One run's setup. ``seq``: tokens per sequence (global); ``world`` = dp·cp ranks; ``loss_chunk``:
    tokens per loss chunk (None: the default of
    :mod:`seqpar.integrations.loss`, 256 MiB of fp32 logits; 0: the full ``[T, V]`` logits at once); ``device``: ``"cuda"``
    (FSDP2 prefetches the next layer in forward too) or ``"cpu"``; ``ranks_per_node``: USP's default
    Ulysses degree is gcd(cp, ranks_per_node) unless ``ulysses_degree`` is given."""

    seq: int
    world: int
    cp: int
    method: str = "zigzag_ring"
    checkpointing: str = "none"
    dtype: str = "bfloat16"
    micro_batch: int = 1
    loss_chunk: int | None = None
    device: str = "cuda"
    ranks_per_node: int = 8
    ulysses_degree: int | None = None

    def __post_init__(self) -> None:
        for flag, v in (("seq", self.seq), ("world", self.world), ("cp", self.cp), ("micro-batch", self.micro_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{flag}={v!r}: expected a positive integer")
        if self.world % self.cp:
            raise ValueError(f"--cp={self.cp}: must divide --world={self.world} (dp = world / cp ranks)")
        declared(self.method, argument="--method", kind="softmax")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--checkpointing={self.checkpointing!r}: choose one of {', '.join(CHECKPOINTING)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.loss_chunk is not None and (isinstance(self.loss_chunk, bool) or self.loss_chunk < 0):
            raise ValueError(f"--loss-chunk={self.loss_chunk!r}: expected a number of tokens per chunk (0: the "
                             "full logits; default: 256 MiB of fp32 logits, as seqpar.integrations.loss)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"--device={self.device!r}: 'cuda' or 'cpu'")
        unit = self.cp * declared(self.method).layout_multiple
        if self.seq % unit:
            raise ValueError(f"--seq={self.seq}: {self.method} on cp={self.cp} needs a multiple of {unit} tokens")
        if self.method == "usp" and self.cp % self.usp_degree:
            raise ValueError(f"--ulysses-degree={self.ulysses_degree}: must divide --cp={self.cp}")

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def e(self) -> int:
        return DTYPES[self.dtype]

    @property
    def tokens(self) -> int:
        """Tokens a rank holds: micro_batch·seq/cp."""
        return self.micro_batch * self.seq // self.cp

    @property
    def usp_degree(self) -> int:
        """The Ulysses degree of usp (1 for other methods but ulysses, whose degree is cp)."""
        import math

        if self.method == "ulysses":
            return self.cp
        if self.method != "usp":
            return 1
        return self.ulysses_degree or math.gcd(self.cp, self.ranks_per_node)


def _heads_used(m: ModelShape, degree: int) -> tuple[int, int]:
    """(query heads, KV heads) the busiest member of a Ulysses axis of ``degree`` ranks holds: the first
    ``Hq % degree`` members one query head more; a member needs every KV head its query heads use."""
    if degree > m.heads:
        raise ValueError(f"--cp: a Ulysses axis of {degree} ranks needs at least {degree} query heads, the model "
                         f"has {m.heads}; choose a ring-family --method or a smaller Ulysses degree")
    base, extra = divmod(m.heads, degree)
    group = m.heads // m.kv_heads
    best = (0, 0)
    start = 0
    for r in range(degree):
        n = base + (1 if r < extra else 0)
        kv = len({q // group for q in range(start, start + n)})
        best = max(best, (n, kv))
        start += n
    return best


def layer_saved(m: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes per local token one decoder layer keeps for backward without checkpointing, by part."""
    e, h = s.e, m.hidden
    norm = (4 + 2 * e) * h + 4
    u = s.usp_degree
    if u > 1:  # head shards of the u-rank axis (full length of u ranks' tokens, hq/hkv heads of them)
        hq, hkv = _heads_used(m, u)
        d = m.head_dim
        attn = u * (2 * e * hq * d + 2 * e * hkv * d + 4 * hq) + e * m.h_q  # qh, outh, kh, vh, lse; out
    else:
        attn = e * (2 * m.h_q + 2 * m.h_kv) + 4 * m.heads
    return {"norms": 2 * norm, "attention": attn, "mlp": 4 * e * m.intermediate}


def checkpoint_saved(m: ModelShape, s: Setup) -> int:
    """Bytes per local token a checkpointed layer keeps between its forward and its backward."""
    e = s.e
    if s.checkpointing == "none":
        return sum(layer_saved(m, s).values())
    kept = e * m.hidden
    if s.checkpointing == "attention":
        kept += e * m.h_q + 4 * m.heads  # the tape's out and lse
        u = s.usp_degree
        if u > 1:
            hq, _ = _heads_used(m, u)
            kept += u * hq * (e * m.head_dim + 4) - 4 * m.heads  # head-sharded out (and its lse instead)
    return kept


def attention_buffers(m: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes per local token the method holds inside one layer's attention (forward, backward), besides
    what the layer saves. From the methods' ``buffers`` trait (docs/methods.md):

    - ``kv_double``: K,V of the current and the next ring step ``2·2e·h_kv``; fp32 out and lse
      accumulators ``4(h_q + Hq)`` and a block's fp32 output; backward: fp32 dq ``4h_q``, this shard's
      fp32 dK,dV ``8h_kv`` and the travelling one in and out ``16h_kv``, the block's gradients;
    - ``kv_gathered``: every rank's K,V ``cp·2e·h_kv`` (and in backward every rank's fp32 dK,dV
      ``cp·8h_kv`` before the reduce-scatter);
    - ``q_partials`` (TokenRing): q in flight both ways, fp32 partial outputs and lse;
    - ``head_shards``: all-to-all send and receive copies of q, k, v (and of out, dout, dq, dk, dv).
    """
    e, hq, hkv, H = s.e, m.h_q, m.h_kv, m.heads
    kind = declared(s.method).buffers
    block_f = 4 * (hq + H)  # one block's fp32 (out, lse) before the merge
    block_b = e * (hq + 2 * hkv) + e * (hq + 2 * hkv)  # a block's dq, dk, dv and the final casts
    if kind == "kv_gathered":
        fwd = s.cp * 2 * e * hkv + 4 * (hq + H) + block_f
        bwd = s.cp * (2 * e * hkv + 8 * hkv) + 8 * hkv + 4 * hq + block_b
    elif kind == "q_partials":
        fwd = 2 * e * hq + 2 * (4 * hq + 4 * H) + 4 * (hq + H) + block_f
        bwd = 2 * (2 * e * hq + 8 * H) + 2 * 4 * hq + 4 * hq + 8 * hkv + block_b
    elif kind == "head_shards":
        u = s.usp_degree
        qh, kvh = _heads_used(m, u)
        d = m.head_dim
        shards = u * e * d * (qh + 2 * kvh)  # one head-sharded copy of q, k, v
        ring = 0 if s.method == "ulysses" else u * (2 * 2 * e * kvh * d + 4 * (qh * d + qh))
        fwd = shards + e * hq + ring + u * 4 * qh * (d + 1)
        bwd = 2 * shards + 2 * e * hq + e * (hq + 2 * hkv) + 2 * ring
    else:  # kv_double
        fwd = 2 * 2 * e * hkv + 4 * (hq + H) + block_f
        bwd = 2 * 2 * e * hkv + 4 * hq + 8 * hkv + 16 * hkv + block_b
    return {"forward": fwd, "backward": bwd}


#: seqpar.integrations.loss's default chunk: 256 MiB of one chunk's fp32 logits
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(m: ModelShape, s: Setup) -> int | None:
    """Tokens per loss chunk: ``loss_chunk``, or by default as :mod:`seqpar.integrations.loss` chooses
    (256 MiB of fp32 logits: 512 tokens at a 128K vocabulary); None for the full logits (``loss_chunk=0``)."""
    if s.loss_chunk == 0:
        return None
    return s.loss_chunk if s.loss_chunk is not None else max(1, LOSS_CHUNK_BYTES // (4 * m.vocab))


def loss_terms(m: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes of the loss at its forward and backward peaks, and what stays during backward (``kept``).

    Full logits (``loss_chunk=0``; ``context_parallel_loss`` over ``model(...).logits``): the ``[T, V]``
    logits in the compute dtype (kept by the model's output until backward ends), their fp32 copy
    (bfloat16/float16; not saved), log-softmax's fp32 output (saved); backward: the gradients of the
    loss and of log-softmax, ``8V`` per token. Chunked (:func:`seqpar.integrations.loss.causal_lm_loss`:
    gradients computed in forward, chunk by chunk): the hidden states' gradient ``e·h·T`` and the head's
    fp32 gradient ``4·V·h`` accumulate in forward; per chunk of c tokens its logits in the compute
    dtype and in fp32, the softmax in place, its compute-dtype copy and the chunk's weight-gradient
    product ``e·V·h``; backward casts the head's gradient to the compute dtype ``e·V·h``.
    """
    e, V, h = s.e, m.vocab, m.hidden
    cast = 4 if e != 4 else 0
    c = loss_chunk_tokens(m, s)
    if c is None:
        T = s.tokens
        return {"forward": T * (e * V + cast * V + 4 * V), "backward": T * (e * V + 4 * V + 8 * V),
                "kept": T * e * V}
    c = min(c, s.tokens)
    grads = e * h * s.tokens + 4 * V * h
    at_cast = c * V * (e + cast)  # the chunk's logits in the compute dtype and their fp32 copy
    at_weight_grad = 4 * c * V + (e * c * V if e != 4 else 0) + e * V * h  # softmax, its cast, g.T @ h
    return {"forward": grads + max(at_cast, at_weight_grad),
            "backward": grads + (e * V * h if e != 4 else 0), "kept": 0}


@dataclass(frozen=True)
class Plan:
    """The prediction: ``moments`` (name, {component: bytes}) in step order; ``peak`` the largest total."""

    model: ModelShape
    setup: Setup
    moments: tuple[tuple[str, dict], ...] = field(repr=False)

    @property
    def peak(self) -> int:
        return max(sum(parts.values()) for _, parts in self.moments)

    @property
    def peak_phase(self) -> str:
        return max(self.moments, key=lambda mp: sum(mp[1].values()))[0]

    def components(self) -> dict[str, int]:
        """Bytes by component at the peak moment."""
        return dict(next(parts for name, parts in self.moments if name == self.peak_phase))

    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "params": self.model.params, "setup": asdict(self.setup),
                "dp": self.setup.dp, "tokens_per_rank": self.setup.tokens, "peak_bytes": self.peak,
                "peak_phase": self.peak_phase, "components": self.components(),
                "moments": {name: sum(parts.values()) for name, parts in self.moments}}


def _static(m: ModelShape, s: Setup) -> dict[str, int]:
    shard = -(-m.params // s.world)  # FSDP2 pads each parameter's dim 0 to a multiple of S; ~exact
    return {"parameters": 4 * shard, "optimizer": 8 * shard}


def _kept_beside_recompute(m: ModelShape, s: Setup, kept: int) -> int:
    """What a checkpointed layer keeps that its recomputation does not hold again (per token): in
    float32 the first norm saves the layer input itself, and ``"attention"``'s out and lse are the
    recorded tensors the replay hands back."""
    if s.checkpointing == "none":
        return 0
    shared = 4 * m.hidden if s.e == 4 else 0
    if s.checkpointing == "attention":
        shared += kept - s.e * m.hidden
    return kept - shared


def moments(m: ModelShape, s: Setup) -> tuple[tuple[str, dict], ...]:
    """The step's moments, each ``{component: bytes}`` (components: parameters, optimizer, gradients,
    fsdp, activations, layer, attention, loss); see the module docstring for what each holds."""
    e, T, L, h = s.e, s.tokens, m.layers, m.hidden
    static = _static(m, s)
    saved = layer_saved(m, s)
    full, kept = sum(saved.values()), checkpoint_saved(m, s)
    buf, loss = attention_buffers(m, s), loss_terms(m, s)
    norm = saved["norms"] // 2
    glob = 2 * m.head_dim * e + 24  # rotary cos and sin, input ids, positions, labels
    root, lay = e * m.root_params, e * m.layer_params
    head_grad = e * m.vocab * h  # the head's unsharded gradient, from the loss's backward to the end
    g_shard = 4 * -(-m.layer_params // s.world)
    fwd_layers = 2 if s.device == "cuda" else 1  # CUDA: the next layer's all-gather runs ahead
    rs = 4 * m.layer_params  # the fp32 reduce-scatter input the layer's gradients are copied (and cast) into
    out = []
    if s.checkpointing == "none":
        working = full
    else:  # inside a checkpointed forward nothing is saved: its largest temporaries (q, k, v / the MLP's)
        working = kept + max(e * (h + m.h_q + 2 * m.h_kv), 3 * e * m.intermediate)
    out.append(("forward", {**static, "fsdp": root + fwd_layers * lay, "activations": T * ((L - 1) * kept + glob),
                            "layer": T * working, "attention": T * buf["forward"]}))
    acts = T * (L * kept + glob + norm)
    out.append(("loss forward", {**static, "fsdp": root, "activations": acts, "loss": loss["forward"]}))
    out.append(("loss backward", {**static, "fsdp": root, "activations": acts, "loss": loss["backward"]}))
    # the final norm's backward: every layer's activations, its incoming gradient e·h and RMSNorm's
    # backward temporaries: the gradient of its normalised input e·h, that in fp32 (bf16/fp16), the
    # input's gradient through the scale and the product the rsqrt's gradient sums, 4h each
    norm_bwd = e * h + e * h + (4 * h if e != 4 else 0) + 8 * h
    out.append(("final norm backward", {**static, "fsdp": root + head_grad, "activations": acts,
                                        "layer": T * norm_bwd, "loss": loss["kept"]}))
    # CUDA: the previous layer's reduce-scatter input is held until its stream finishes (FSDP2 waits on it
    # at the next layer's end); on CPU (gloo) the reduce-scatter has finished before the next layer starts
    in_flight = rs if s.device == "cuda" else 0
    for i in range(L - 1, -1, -1):
        common = {**static, "gradients": (L - 1 - i) * g_shard,  # gathered: this layer and the prefetched one
                  "fsdp": root + head_grad + 2 * lay + lay + in_flight,  # + this layer's unsharded gradients
                  "activations": T * (i * kept + glob + _kept_beside_recompute(m, s, kept)),
                  "loss": loss["kept"]}
        mlp = T * (full + e * h + 2 * e * m.intermediate)
        attn = T * (norm + saved["attention"] + 2 * e * h)
        out.append((f"backward layer {i} mlp", {**common, "layer": mlp}))
        out.append((f"backward layer {i} attention", {**common, "layer": attn, "attention": T * buf["backward"]}))
        if s.checkpointing == "layer":  # the recomputation runs the attention forward again
            out.append((f"recompute layer {i}", {**common, "layer": T * (norm + saved["attention"]),
                                                 "attention": T * buf["forward"]}))
    opt_temp = 4 * -(-m.params // s.world) if s.device == "cuda" else 4 * -(-m.vocab * h // s.world)
    out.append(("optimizer", {**static, "gradients": 4 * -(-m.params // s.world), "fsdp": opt_temp}))
    return tuple(out)


def plan(model: ModelShape, setup: Setup) -> Plan:
    """Each rank's predicted memory over one training step of ``model`` under ``setup``."""
    return Plan(model, setup, moments(model, setup))
