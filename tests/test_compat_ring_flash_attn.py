"""seqpar.compat.ring_flash_attn: ring-flash-attention's API on seqpar, checked in its own layouts.

Every case builds the global tensors, cuts each rank's input the way ring-flash-attention's own
tests do (contiguous chunks, zigzag chunks r and 2N-1-r, stripes i mod N, per-document splits with
local cu_seqlens = global // N, contiguous pieces of the packed stream), runs the compat function
forward and backward on gloo ranks, and compares the local output, lse and every local gradient
with the same cut of a float64 reference that knows nothing of seqpar (explicit masked scores,
flash-attn's window_size semantics). Many cases share one ``run_distributed`` call.

Also: the stream layout through ``seqpar.attention`` / ``seqpar.shard``; the HF adapter against the
single-process model (logits and every parameter gradient); bad inputs raise on every rank.
"""

from __future__ import annotations

import functools

import pytest
import torch

import seqpar
import seqpar.compat.ring_flash_attn as rfa
from seqpar.testing import run_distributed

from dist_utils import rel_err, world
from model_folders import spread_weights

# fp32: every path accumulates in fp32 over at most ~100 keys: ~1e-7 relative per operation, so 2e-5
# of the largest magnitude leaves room while a wrong mask, chunk or head routing gives errors ~1e-1.
FP32_TOL = 2e-5
# bf16: at most 2x as far from float64 as the same plain attention computed in bf16 on one device
# (flash-attention's test rule, STYLE.md 12), compared on the same rows; the floor absorbs cases
# where that baseline is unusually lucky. Measured: at most 2.1x + floor (torch's CPU SDPA in bf16,
# which accumulates in fp32, is a stricter baseline: seqpar.attention's own windowed zigzag at N = 3
# is up to 3.1x that on one rank's rows, a largest-element statistic: over whole tensors it is
# 0.78-0.94x SDPA's error, benchmarks/results/numerics_window.md).
BF16_FACTOR, BF16_FLOOR = 2.0, 2e-3
# lse (fp32 in every dtype) from inputs the float64 reference sees rounded the same way: fp32
# measured <= 1.4e-7 relative; bf16 <= 1.3e-5 (torch's CPU bf16 kernel on a whole one-device
# sequence keeps some steps in bf16). A wrong mask, chunk or scale moves lse by 1e-2 or more.
LSE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
TIMEOUT = 300
# small tensors: intra-op threads only slow the in-process cases down on a busy 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- reference


def _allowed(T, causal, window_size, cu=None):
    """[T, T] bool: flash-attn's visibility (window_size=(left, right), -1 unbounded; per document)."""
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    ok = torch.ones(T, T, dtype=torch.bool)
    if causal:
        ok &= j <= i
    left, right = window_size
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if cu is not None:
        doc = torch.bucketize(torch.arange(T), torch.tensor(cu[1:]), right=True)
        ok &= doc[:, None] == doc[None, :]
    return ok


def _reference(q, k, v, allowed, scale=None):
    """Plain attention [B, T, Hq, D] with GQA by head groups; returns (out, lse [B, Hq, T])."""
    B, T, Hq, D = q.shape
    g = Hq // k.shape[2]
    kk, vv = (x.repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * (scale if scale is not None else D ** -0.5)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vv)
    return out, lse


def _low_precision_reference(q, k, v, dout, allowed):
    """The same plain attention computed in the inputs' low dtype (flash-attention's own tests'
    baseline, ``attention_ref`` without upcasting): ``(out, dq, dk, dv)``."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = _reference(*leaves, allowed)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


# ----------------------------------------------------------------------------- the original's cuts


def _cut(x, how, rank, n, dim=1, cu=None):
    """Rank ``rank``'s part of global ``x`` along ``dim`` as ring-flash-attention's tests cut it."""
    x = x.movedim(dim, 0)
    if how == "ring":
        part = x.chunk(n)[rank]
    elif how == "zigzag":
        c = x.chunk(2 * n)
        part = torch.cat([c[rank], c[2 * n - 1 - rank]])
    elif how == "stripe":
        part = x[rank::n]
    elif how == "varlen_ring":
        part = torch.cat([x[a:b].chunk(n)[rank] for a, b in zip(cu, cu[1:])])
    elif how == "varlen_zigzag":
        part = torch.cat([_cut(x[a:b], "zigzag", rank, n, dim=0) for a, b in zip(cu, cu[1:])])
    elif how == "llama3":
        t = x.shape[0] // n
        part = x[rank * t:(rank + 1) * t]
    return part.movedim(0, dim).contiguous()


DENSE = {"ring": ("ring", rfa.ring_flash_attn_func, rfa.ring_flash_attn_kvpacked_func,
                  rfa.ring_flash_attn_qkvpacked_func),
         "zigzag": ("zigzag", rfa.zigzag_ring_flash_attn_func, rfa.zigzag_ring_flash_attn_kvpacked_func,
                    rfa.zigzag_ring_flash_attn_qkvpacked_func),
         "stripe": ("stripe", rfa.stripe_flash_attn_func, rfa.stripe_flash_attn_kvpacked_func,
                    rfa.stripe_flash_attn_qkvpacked_func)}
VARLEN = {"varlen_ring": (rfa.ring_flash_attn_varlen_func, rfa.ring_flash_attn_varlen_kvpacked_func,
                          rfa.ring_flash_attn_varlen_qkvpacked_func),
          "varlen_zigzag": (rfa.zigzag_ring_flash_attn_varlen_func, rfa.zigzag_ring_flash_attn_varlen_kvpacked_func,
                            rfa.zigzag_ring_flash_attn_varlen_qkvpacked_func),
          "llama3": (rfa.llama3_flash_attn_varlen_func, rfa.llama3_flash_attn_varlen_kvpacked_func,
                     rfa.llama3_flash_attn_varlen_qkvpacked_func)}
FORMS = ("plain", "kvpacked", "qkvpacked")


def _call(case, q, k, v, n, rank):
    """Run the case's function on local leaves in its packed form; returns (result, grads getter)."""
    form, kw = case["form"], dict(causal=case["causal"], window_size=case["window_size"],
                                  return_attn_probs=case["lse"], softmax_scale=case.get("scale"))
    packed_dim = 2 if case["layout"] in DENSE else 1
    if form == "plain":
        leaves = [x.requires_grad_() for x in (q, k, v)]
        args = leaves
    elif form == "kvpacked":
        leaves = [q.requires_grad_(), torch.stack([k, v], dim=packed_dim).requires_grad_()]
        args = leaves
    else:
        leaves = [torch.stack([q, k, v], dim=packed_dim).requires_grad_()]
        args = leaves
    if case["layout"] in DENSE:
        fn = DENSE[case["layout"]][1 + FORMS.index(form)]
        res = fn(*args, **kw)
    else:
        fn = VARLEN[case["layout"]][FORMS.index(form)]
        cu = case["cu"]
        if case["layout"] == "llama3":
            cq, ck, mq, mk, ks = rfa.llama3_flash_attn_prepare_cu_seqlens(
                torch.tensor(cu, dtype=torch.int32, device=q.device), case["causal"], rank, n)
            res = fn(*args, cq, ck, mq, mk, 1, ks, **kw)
        else:
            local = torch.tensor(cu, dtype=torch.int32, device=q.device) // n
            res = fn(*args, local, int((local[1:] - local[:-1]).max()), **kw)

    def grads():
        if form == "plain":
            return [x.grad for x in leaves]
        if form == "kvpacked":
            return [leaves[0].grad] + list(leaves[1].grad.unbind(packed_dim))
        return list(leaves[0].grad.unbind(packed_dim))

    return res, grads


def _global(case, n):
    """Global float64 inputs (rounded through the case's dtype), dout, the visibility mask."""
    B, T, Hq, Hkv, D = case["shape"]
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = case["dtype"]
    shapes = [(B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, Hq, D)]
    xs = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes]
    allowed = _allowed(T, case["causal"], case["window_size"], case.get("cu"))
    return xs, allowed


def _one_case(case):
    rank, n = world()
    (q, k, v, dout), allowed = _global(case, n)
    varlen = case["layout"] in VARLEN
    dtype, how, cu = case["dtype"], case["layout"], case.get("cu")
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = _reference(*ref, allowed, case.get("scale"))
    out_ref.backward(dout)
    expect = [out_ref.detach(), ref[0].grad, ref[1].grad, ref[2].grad]
    if varlen:  # [1, T, ...] -> [T, ...]: the packed functions take the stream without a batch dim
        q, k, v, dout = (x[0] for x in (q, k, v, dout))
        expect = [x[0] for x in expect]
    device = torch.device(case.get("device", "cpu"))
    local = [_cut(x.to(dtype), how, rank, n, dim=0 if varlen else 1, cu=cu).to(device) for x in (q, k, v)]
    res, grads = _call(case, *local, n, rank)
    out = res[0] if case["lse"] else res
    out.backward(_cut(dout.to(dtype), how, rank, n, dim=0 if varlen else 1, cu=cu).to(device))
    assert out.device == device
    got = [x.cpu() for x in [out.detach()] + grads()]
    errs = [rel_err(a, _cut(b, how, rank, n, dim=0 if varlen else 1, cu=cu)) for a, b in zip(got, expect)]
    dtypes_ok = out.dtype == dtype and all(g.dtype == dtype for g in got[1:])
    row = {"errs": errs, "dtypes_ok": dtypes_ok, "lse": None, "base": None}
    if case["lse"]:
        lse = res[1].cpu()
        assert res[2] is None
        want = lse_ref.detach()[0] if varlen else lse_ref.detach()  # varlen: [H, T]
        row["lse"] = rel_err(lse, _cut(want, how, rank, n, dim=1 if varlen else 2, cu=cu))
        row["lse_shape_ok"] = tuple(lse.shape) == ((q.shape[1], local[0].shape[0]) if varlen else
                                                   (q.shape[0], q.shape[2], local[0].shape[1]))
    if dtype == torch.bfloat16:
        base_in = [x.unsqueeze(0) if varlen else x for x in (q, k, v, dout)]
        base = _low_precision_reference(*(x.to(dtype) for x in base_in), allowed)
        # the baseline's error on the same rows as this rank's (a slice's largest value sets the scale)
        cut = functools.partial(_cut, how=how, rank=rank, n=n, dim=0 if varlen else 1, cu=cu)
        row["base"] = [rel_err(cut(b[0] if varlen else b), cut(e)) for b, e in zip(base, expect)]
    return row


def _run_cases(cases):
    return [_one_case(c) for c in cases]


def _check(results, cases):
    for rank, rows in enumerate(results):
        for case, row in zip(cases, rows):
            label = f"rank {rank} {case['layout']}/{case['form']} causal={case['causal']} " \
                    f"window={case['window_size']} {case['dtype']}"
            assert row["dtypes_ok"], f"{label}: output or gradient dtype differs from the input dtype"
            for name, e, i in zip(("out", "dq", "dk", "dv"), row["errs"], range(4)):
                if case["dtype"] == torch.float32:
                    assert e <= FP32_TOL, f"{label} {name}: error {e:.2e} > {FP32_TOL:.0e}"
                else:
                    bound = BF16_FACTOR * row["base"][i] + BF16_FLOOR
                    assert e <= bound, \
                        f"{label} {name}: error {e:.2e} > 2 x bf16 reference {row['base'][i]:.2e} + floor"
            if case["lse"]:
                assert row["lse_shape_ok"], f"{label}: lse has the wrong shape"
                tol = LSE_TOL[case["dtype"]]
                assert row["lse"] <= tol, f"{label} lse: error {row['lse']:.2e} > {tol:.0e}"


def _cases(n, dtype):
    """Every function (3 layouts x 3 forms dense, 3 x 3 packed), causal and not, windows, lse, GQA."""
    # Hq = 4 with Hkv = 2 (GQA), except qkvpacked (one head count for q, k and v)
    T = 2 * n * 7  # zigzag chunks of 7 tokens: odd
    cases = []
    for layout in DENSE:
        for f, form in enumerate(FORMS):
            for causal in (True, False):
                window = (5, 0) if causal and form == "kvpacked" else (4, 4) if not causal and f == 0 else (-1, -1)
                cases.append(dict(layout=layout, form=form, causal=causal, window_size=window, dtype=dtype,
                                  lse=form != "kvpacked", shape=(2, T, 4, 4 if form == "qkvpacked" else 2, 16),
                                  seed=len(cases)))
    docs = {"varlen_ring": [n, 5 * n, 2 * n, 3 * n], "varlen_zigzag": [2 * n, 6 * n, 2 * n],
            "llama3": [1, 8, 2 * n + 1, 17, 1]}
    for layout, lens in docs.items():
        if layout == "llama3":
            lens = lens + [-sum(lens) % n or n]  # T_total a multiple of N; documents cross ranks
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        for f, form in enumerate(FORMS):
            for causal in (True, False):
                window = (3, 0) if causal and form == "plain" else (-1, -1)
                cases.append(dict(layout=layout, form=form, causal=causal, window_size=window, dtype=dtype,
                                  lse=form != "qkvpacked", shape=(1, cu[-1], 4, 4 if form == "qkvpacked" else 2, 16),
                                  cu=cu, seed=len(cases), scale=0.3 if form == "kvpacked" else None))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 3])
def test_every_function(n, dtype):
    """Every function and packed form, causal and not, windows, lse, GQA: forward, lse and every
    gradient against float64, in the original's layouts (36 cases in one distributed call)."""
    cases = _cases(n, dtype)
    _check(run_distributed(_run_cases, n, cases, timeout=TIMEOUT), cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_function_one_device(device, dtype):
    """The same cases in one process (no process group: one device), on CPU and on CUDA tensors."""
    cases = [dict(c, device=device) for c in _cases(1, dtype)]
    _check([_run_cases(cases)], cases)


# ----------------------------------------------------------------------------- the stream layout in seqpar


STREAM_LENS = (1, 9, 7, 1, 30, 4)  # a document of length 1 first; documents cross ranks; one spans ranks


def _stream_cu(n):
    lens = list(STREAM_LENS) + [-sum(STREAM_LENS) % n or n]  # a multiple of N tokens
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    return cu


def _stream_attention(dtype):
    """seqpar.attention with a stream layout (packed_layout(split="stream")), through seqpar.shard
    and seqpar.unshard: out and every gradient against float64, plus the shard round trip."""
    rank, n = world()
    cu = _stream_cu(n)
    layout = seqpar.packed_layout(torch.tensor(cu, dtype=torch.int32), method="ring", split="stream")
    rows = []
    for causal, window in ((True, None), (False, None), (True, 4), (False, 3)):
        case = dict(shape=(1, cu[-1], 4, 2, 16), dtype=dtype, causal=causal, cu=cu, seed=len(rows),
                    window_size=(-1, -1) if window is None else (window - 1, 0 if causal else window - 1))
        (q, k, v, dout), allowed = _global(case, n)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        out_ref, _ = _reference(*ref, allowed)
        out_ref.backward(dout)
        local = [seqpar.shard(x.to(dtype), method="ring", cu_seqlens=layout).requires_grad_() for x in (q, k, v)]
        out = seqpar.attention(*local, method="ring", cu_seqlens=layout, causal=causal, window=window)
        out.backward(seqpar.shard(dout.to(dtype), method="ring", cu_seqlens=layout))
        got = [seqpar.unshard(x, method="ring", cu_seqlens=layout) for x in (out.detach(), *(t.grad for t in local))]
        errs = [rel_err(a, b) for a, b in zip(got, (out_ref.detach(), *(t.grad for t in ref)))]
        low = _low_precision_reference(*(x.to(dtype) for x in (q, k, v, dout)), allowed)
        base = [rel_err(a, b) for a, b in zip(low, (out_ref.detach(), *(t.grad for t in ref)))]
        rows.append((causal, window, errs, base, tuple(local[0].shape)))
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 3])
def test_stream_layout_through_seqpar_attention(n, dtype):
    for rank, rows in enumerate(run_distributed(_stream_attention, n, dtype, timeout=TIMEOUT)):
        for causal, window, errs, base, shape in rows:
            assert shape[1] * n == _stream_cu(n)[-1], f"rank {rank}: local piece of {shape[1]} rows"
            for name, e, b in zip(("out", "dq", "dk", "dv"), errs, base):
                bound = FP32_TOL if dtype == torch.float32 else BF16_FACTOR * b + BF16_FLOOR
                assert e <= bound, f"rank {rank} causal={causal} window={window} {name}: error {e:.2e} > {bound:.1e}"


def test_stream_layout_geometry():
    """Pieces, local offsets and refusals of the stream layout (no ranks needed)."""
    from seqpar.layouts import StreamLayout, stream_layout
    from seqpar.softmax.stream import pair_segments, stream_schedule

    lay = stream_layout([0, 1, 10, 14, 20], 2)
    assert lay.t_local == 10
    assert lay.pieces == (((0, 0, 1), (1, 1, 10)), ((2, 10, 14), (3, 14, 20)))
    assert lay.local_cu_seqlens(1) == (0, 4, 10)
    crossing = StreamLayout(2, (0, 3, 17, 20))  # document 1 runs from rank 0 into rank 1
    assert crossing.pieces[1] == ((1, 10, 17), (2, 17, 20))
    assert crossing.doc_starts(1) == (3, 17)
    # rank 1's queries of document 1 need rank 0's keys 3..9, nothing of document 0
    (seg,) = pair_segments(crossing, 1, 0, causal=True, window=None)
    assert (seg.q_start, seg.q_len, seg.k_start, seg.k_len, seg.mask) == (0, 7, 3, 7, "none")
    assert pair_segments(crossing, 0, 1, causal=True, window=None) == []

    def moves(layout, rank):  # (payload, owner, sent?, rows) of every message of rank's schedule
        return [(m.what, (rank + m.owner) % layout.n, m.send, (m.rows.start, m.rows.stop))
                for step in stream_schedule(layout, rank, causal=True).steps for m in step.moves]

    assert moves(stream_layout([0, 10, 20], 2), 0) == moves(stream_layout([0, 10, 20], 2), 1) == []  # nothing crosses
    # only the 7 K,V rows rank 1's queries need travel (and their dK,dV back); rank 0 needs nothing of rank 1
    assert moves(crossing, 1) == [("kv", 0, False, (3, 10)), ("dkv", 0, True, (3, 10))]
    assert moves(crossing, 0) == [("kv", 0, True, (3, 10)), ("dkv", 0, False, (3, 10))]
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        stream_layout([0, 5, 10], 3)
    with pytest.raises(ValueError, match="method='ring'"):
        seqpar.packed_layout([0, 4], method="zigzag_ring", split="stream")
    with pytest.raises(ValueError, match="split="):
        seqpar.packed_layout([0, 4], method="ring", split="rows")


# ----------------------------------------------------------------------------- the HF adapter

VOCAB = 96
DOC_LENS = (5, 13, 1, 20, 9, 3)  # a one-token document; documents cross the rank boundaries


def _tiny_model(kind, seed=0):
    """A tiny GQA Llama, or Mistral with a sliding window of 5 tokens (shorter than most documents)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MistralForCausalLM(MistralConfig(**common, head_dim=16, sliding_window=5))
    spread_weights(model)  # larger weights than initializer_range: sharper logits, a sharper comparison
    return model


def _packed_batch(n):
    """A packed stream of documents (T a multiple of N), restarting position ids, next-token labels
    inside each document (-100 at each document's last token)."""
    lens = list(DOC_LENS) + [-sum(DOC_LENS) % n or n]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(L) for L in lens])[None]
    labels = torch.full_like(ids, -100)
    cu = [0]
    for L in lens:
        a = cu[-1]
        labels[0, a:a + L - 1] = ids[0, a + 1:a + L]
        cu.append(a + L)
    return ids, pos, labels, cu


def _hf_adapter(kind):
    """Logits and every summed parameter gradient of the drop-in path, called as axolotl calls it,
    against the single-process model (sdpa, documents masked apart by the position ids); DATA_PARAMS
    as the original fills it; then use_ring_attn(False) goes back."""
    import copy

    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rank, n = world()
    ids, pos, labels, cu = _packed_batch(n)
    count = int((labels != -100).sum())
    ref = _tiny_model(kind)
    ref.config._attn_implementation = "sdpa"
    logits_ref = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    F_ce = torch.nn.functional.cross_entropy
    (F_ce(logits_ref[0], labels[0], reduction="sum", ignore_index=-100) / count).backward()

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    model.config._attn_implementation = "flash_attention_2"
    before, errs = ALL_ATTENTION_FUNCTIONS.get("flash_attention_2"), {}
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = sdpa_attention_forward  # what use_ring_attn(False) returns to
    try:
        # as axolotl calls it: the original's module path, keyword arguments
        rfa.adapters.hf_adapter.substitute_hf_flash_attn(process_group=dist.group.WORLD, heads_k_stride=1)
        rfa.update_ring_flash_attn_params(torch.tensor(cu, dtype=torch.int32), dist.group.WORLD)
        params = rfa.adapters.hf_adapter.DATA_PARAMS  # this rank's llama3 arguments, as the original keeps them
        want = rfa.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(cu, dtype=torch.int32), True, rank, n)
        got = [params[k] for k in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")]
        errs["DATA_PARAMS"] = 0.0 if all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                                         for a, b in zip(got, want)) else float("inf")
        t = ids.shape[1] // n
        mine = slice(rank * t, (rank + 1) * t)
        logits = model(input_ids=ids[:, mine], position_ids=pos[:, mine], use_cache=False).logits
        (F_ce(logits[0], labels[0, mine], reduction="sum", ignore_index=-100) / count).backward()
        gathered = [torch.empty_like(logits) for _ in range(n)]
        dist.all_gather(gathered, logits.detach().contiguous())
        errs["logits"] = rel_err(torch.cat(gathered, dim=1), logits_ref.detach())
        for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # every rank holds its tokens' share of the gradient
            errs[name] = rel_err(grad, p_ref.grad)
        rfa.adapters.hf_adapter.use_ring_attn(False)  # back to the replaced function (sdpa here): causal over the local piece alone
        with torch.no_grad():  # (Llama: without a mask, transformers' sdpa function knows no sliding window)
            local_only = model(input_ids=ids[:, mine], position_ids=pos[:, mine], use_cache=False).logits
            # the same with the sdpa model (a mask of ones: no document separation from the position ids)
            alone = ref(input_ids=ids[:, mine], position_ids=pos[:, mine], attention_mask=torch.ones_like(ids[:, mine]),
                        use_cache=False).logits
        if kind == "llama":
            errs["use_ring_attn(False)"] = rel_err(local_only, alone)
    finally:
        rfa.use_ring_attn(True)
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = before
    return errs


@pytest.mark.parametrize("n,kind", [(2, "llama"), (3, "llama"), (2, "mistral")])
def test_hf_adapter_matches_single_process_model(n, kind):
    """substitute_hf_flash_attn + update_ring_flash_attn_params on a tiny GQA model fed contiguous
    pieces of a packed stream (Mistral: its sliding window too): gathered logits and summed gradients
    equal the single-process model's (fp32: two summation orders of the same rounding, 2e-5 of the
    largest magnitude)."""
    for rank, errs in enumerate(run_distributed(_hf_adapter, n, kind, timeout=TIMEOUT)):
        assert len(errs) > 10  # logits, every parameter, the switch
        for name, e in errs.items():
            assert e <= FP32_TOL, f"rank {rank} {name}: error {e:.2e} > {FP32_TOL:.0e}"


# the original's (0.1.8) modules and what each defines, as code imports them
PEER_MODULES = {
    "ring_flash_attn": ("ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func"),
    "zigzag_ring_flash_attn": ("zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
                               "zigzag_ring_flash_attn_qkvpacked_func"),
    "stripe_flash_attn": ("stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
                          "stripe_flash_attn_qkvpacked_func"),
    "ring_flash_attn_varlen": ("ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
                               "ring_flash_attn_varlen_qkvpacked_func"),
    "zigzag_ring_flash_attn_varlen": ("zigzag_ring_flash_attn_varlen_func",
                                      "zigzag_ring_flash_attn_varlen_kvpacked_func",
                                      "zigzag_ring_flash_attn_varlen_qkvpacked_func"),
    "llama3_flash_attn_varlen": ("llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
                                 "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func"),
    "adapters": ("substitute_hf_flash_attn", "update_ring_flash_attn_params"),
    "adapters.hf_adapter": ("substitute_hf_flash_attn", "update_ring_flash_attn_params", "use_ring_attn",
                            "DATA_PARAMS"),
}


def test_the_original_module_paths_serve_the_same_functions():
    """``from ring_flash_attn.<module> import name`` works with seqpar's package name in front, and
    gives the package's own objects (the 21 names of the original's __init__ among them)."""
    import importlib

    for module, names in PEER_MODULES.items():
        mod = importlib.import_module(f"seqpar.compat.ring_flash_attn.{module}")
        for name in names:
            assert getattr(mod, name) is getattr(rfa.adapters.hf_adapter if name == "DATA_PARAMS" else rfa, name), \
                f"{module}.{name}"
    top = {n for module, names in PEER_MODULES.items() if module != "adapters.hf_adapter" for n in names}
    assert len(top) == 21 and top <= set(rfa.__all__)


# ----------------------------------------------------------------------------- bad inputs


def _bad_inputs():
    """Each bad call on every rank; returns (label, exception type name, message) per case."""
    rank, n = world()
    q = torch.randn(1, 4 * n, 4, 8)
    kv = torch.randn(1, 4 * n, 2, 8)
    flat_q, flat_kv = q[0], kv[0]
    cu = torch.tensor([0, 2 * n, 4 * n], dtype=torch.int32)
    cq, ck, mq, mk, ks = rfa.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 3, 4 * n * n]), True, rank, n)
    wrong_slice = slice(ks.start + 1, ks.stop) if rank == n - 1 else ks  # a mistake on the last rank only
    calls = {
        "dropout_p": lambda: rfa.ring_flash_attn_func(q, kv, kv, dropout_p=0.1, causal=True),
        "alibi_slopes": lambda: rfa.zigzag_ring_flash_attn_func(q, kv, kv, alibi_slopes=torch.ones(4), causal=True),
        "window_size": lambda: rfa.stripe_flash_attn_func(q, kv, kv, causal=False, window_size=(2, 3)),
        "qkv": lambda: rfa.ring_flash_attn_qkvpacked_func(torch.randn(1, 4 * n, 2, 4, 8), causal=True),
        "cu_seqlens": lambda: rfa.zigzag_ring_flash_attn_varlen_func(
            flat_q, flat_kv, flat_kv, torch.tensor([0, 1, 4 * n], dtype=torch.int32), 4 * n, causal=True),
        "varlen dropout_p": lambda: rfa.ring_flash_attn_varlen_func(flat_q, flat_kv, flat_kv, cu // n, 2,
                                                                    dropout_p=0.5),
        "heads_k_stride": lambda: rfa.llama3_flash_attn_varlen_func(
            torch.randn(4 * n, 4, 8), torch.randn(4 * n, 2, 8), torch.randn(4 * n, 2, 8), cq, ck, mq, mk, 3, ks,
            causal=True),
        "local_k_slice": lambda: rfa.llama3_flash_attn_varlen_func(
            torch.randn(4 * n, 4, 8), torch.randn(4 * n, 2, 8), torch.randn(4 * n, 2, 8), cq, ck, mq, mk, 1,
            wrong_slice, causal=True),
        "prepare": lambda: rfa.llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 4 * n + 1]), True, rank, n),
        "update_ring_flash_attn_params": lambda: rfa.update_ring_flash_attn_params(torch.tensor([0, 4 * n + 1]), None),
        "one rank's dropout_p": lambda: rfa.ring_flash_attn_func(q, kv, kv, dropout_p=0.1 if rank == n - 1 else 0.0,
                                                                 causal=True),
        "one rank's cu_seqlens": lambda: rfa.zigzag_ring_flash_attn_varlen_func(
            flat_q, flat_kv, flat_kv, torch.tensor([0, 1 if rank == 0 else 2, 4 * n], dtype=torch.int32), 4 * n,
            causal=True),
        "stream method": lambda: seqpar.attention(q, kv, kv, method="zigzag_ring", causal=True,
                                                  cu_seqlens=seqpar.packed_layout([0, 4 * n * n], method="ring",
                                                                                  split="stream")),
    }
    hf_calls, restore = _hf_adapter_bad_calls(rank, n)
    calls.update(hf_calls)
    out = []
    try:
        for label, call in calls.items():
            try:
                call()
                out.append((label, None, ""))
            except Exception as exc:  # noqa: BLE001 - the test inspects every rank's exception
                out.append((label, type(exc).__name__, str(exc)))
    finally:
        restore()
    return out


class _Attention(torch.nn.Module):
    is_causal = True


def _hf_adapter_bad_calls(rank, n):
    """The substituted HF attention function called as a model's layer calls it: attention dropout,
    a padding mask on one rank only, a bad heads_k_stride. Returns (calls, what restores the substitution)."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf, before = rfa.adapters.hf_adapter, ALL_ATTENTION_FUNCTIONS.get("flash_attention_2")
    hf.substitute_hf_flash_attn(process_group=dist.group.WORLD, heads_k_stride=1)
    hf.update_ring_flash_attn_params(torch.tensor([0, 3, 4 * n], dtype=torch.int32), dist.group.WORLD)
    attn = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)  # (1, H, T_local, D) as the layer passes them
    mask = torch.ones(1, 4, dtype=torch.long)
    if rank == n - 1:
        mask[0, -1] = 0
    return {"HF dropout": lambda: attn(_Attention(), q, k, k, None, dropout=0.1),
            "HF one rank's padding mask": lambda: attn(_Attention(), q, k, k, mask),
            "HF heads_k_stride": lambda: hf.substitute_hf_flash_attn(dist.group.WORLD, heads_k_stride=0)}, \
        lambda: ALL_ATTENTION_FUNCTIONS.__setitem__("flash_attention_2", before)


EXPECTED = {"dropout_p": "dropout_p=0.1", "alibi_slopes": "alibi_slopes", "window_size": "symmetric",
            "qkv": r"qkv has shape", "cu_seqlens": "multiple of 2N", "varlen dropout_p": "dropout_p=0.5",
            "heads_k_stride": "heads_k_stride=3", "local_k_slice": "local_k_slice|rank", "prepare": "multiple of the",
            "update_ring_flash_attn_params": "multiple of the", "one rank's dropout_p": "dropout_p=0.1",
            "one rank's cu_seqlens": "multiple of 2N", "stream method": "method='ring'",
            "HF dropout": "dropout: _Attention", "HF one rank's padding mask": "attention_mask: _Attention",
            "HF heads_k_stride": "heads_k_stride=0"}


@pytest.mark.parametrize("n", [2, 3])
def test_bad_inputs_raise_on_every_rank(n):
    """Refused options and inconsistent arguments raise ValueError naming the argument on every rank
    (a mistake on one rank only too), and the ranks stay usable: nothing hangs."""
    import re

    for rank, rows in enumerate(run_distributed(_bad_inputs, n, timeout=TIMEOUT)):
        assert [r[0] for r in rows] == list(EXPECTED)
        for label, kind, message in rows:
            assert kind == "ValueError", f"rank {rank} {label}: {kind}: {message}"
            assert re.search(EXPECTED[label], message), f"rank {rank} {label}: {message}"


# ----------------------------------------------------------------------------- the examples


def _torchrun_example(name: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / name
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert res.returncode == 0, f"{name} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_dropin_example_under_torchrun():
    """examples/ring_flash_attn_dropin.py: 2 ranks, its own assertion against single-process attention."""
    assert "max |local - single-process|" in _torchrun_example("ring_flash_attn_dropin.py")


@pytest.mark.slow
def test_axolotl_example_under_torchrun():
    out = _torchrun_example("axolotl_style.py")
    assert out.count("step ") == 5 and "loss" in out
