"""``seqpar.attention`` inside ``torch.compile`` (seqpar.softmax.compiled): compiled == eager.

A small attention block (q/k/v projections, ``seqpar.attention``, output projection) is compiled
per case, ``fullgraph=True`` and ``False``, and its output and every gradient (input, the four
projection weights, sinks) must equal the same block run eagerly on the same rank (fp32). Eager
seqpar is itself checked against float64 references everywhere else; here the claim is that
compiling changes nothing, so the tolerance is that of re-associated fp32 sums around an identical
attention: Inductor may fuse and reorder the arithmetic around it (observed: exactly 0 for the
block, up to 1e-6 relative for the Llama layers, whose norms and MLP Inductor fuses).

Every compile is verified to have happened: the test's Dynamo backend records each graph, and a case
passes only when exactly one graph was compiled, it contains ``seqpar.attention_fwd`` (no fallback to
eager around the attention) and Dynamo counted no graph break. Each run happens in a fresh pool of
processes (:func:`_fresh`) with Dynamo reset before every case, so no case reuses a compile.

Why the split between default and slow: Inductor on CPU generates and compiles C++ per graph. On
this 2-core machine, shared and loaded (load average 20-40), the first Inductor compile in a process
took 54-84 s (forward and backward of the block, most of it Inductor's one-time start-up), later
cases 2-8 s each; ``aot_eager`` took 8-16 s for the first case (Dynamo's start-up) and 2-6.5 s for
later ones. ``aot_eager`` traces the same graphs, runs the same fake implementations, partitions
forward and backward the same way and runs the same opaque op; what can differ between seqpar
cases under compile is only what the op and its fake do (output and saved-tensor shapes per family
and per rank, the registered options), which ``aot_eager`` covers (with ``opcheck`` of the fake per
case); Inductor adds code generation of the projections around the op, which does not depend on
the method. So by default every method runs under ``aot_eager`` (dense at N = 2, packed at N = 3,
a window, sinks, GQA with uneven Ulysses heads) and Inductor runs once per process it pays
start-up for: the block at ``fullgraph=False`` and a converted Llama compiled per layer. The whole
matrix under Inductor is ``@pytest.mark.slow``. The three default tests used 56 s of CPU in all
(ranks and compilers; measured with a warm Inductor cache, about 44 s more for a cold one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.pool import WorkerPool

pytestmark = pytest.mark.usefixtures("one_thread")

B, T_GLOBAL, HQ, HKV, D, DIM = 1, 24, 4, 2, 8, 16
DOCS = [0, 5, 6, 17, 24]  # packed: documents of 5, 1, 11, 7 tokens (one of length 1)
FP32_COMPILED = 2e-5  # see the module docstring: compiled vs eager fp32, both exact attention


class Block(torch.nn.Module):
    """Projections + ``seqpar.attention`` + output projection, as a decoder layer calls it."""

    def __init__(self, method, *, causal=True, window=None, sinks=False, cu_seqlens=None, stats=None):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(DIM, h * D, generator=gen) / DIM ** 0.5)
                                     for h in (HQ, HKV, HKV))
        self.wo = torch.nn.Parameter(torch.randn(HQ * D, DIM, generator=gen) / DIM ** 0.5)
        self.sinks = torch.nn.Parameter(torch.randn(HQ, generator=gen)) if sinks else None
        self.method, self.causal, self.window, self.cu_seqlens = method, causal, window, cu_seqlens
        self.stats = stats

    def forward(self, x):
        b, t, _ = x.shape
        q = (x @ self.wq).view(b, t, HQ, D)
        k = (x @ self.wk).view(b, t, HKV, D)
        v = (x @ self.wv).view(b, t, HKV, D)
        o = seqpar.attention(q, k, v, method=self.method, causal=self.causal, window=self.window,
                             sinks=self.sinks, cu_seqlens=self.cu_seqlens, stats=self.stats)
        return o.reshape(b, t, HQ * D) @ self.wo


def _run(block, x, dy, params=None):
    params = list(block.parameters() if params is None else params)
    x = x.detach().clone().requires_grad_()
    y = block(x)
    y.backward(dy)
    grads = [x.grad] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return y.detach(), grads


class _Recorder:
    """A Dynamo backend that records every graph it compiles, then hands it to ``backend``."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm.code)
        self.keys = [n.args[-2:] for n in gm.graph.nodes if "attention_fwd" in str(n.target)]
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.backend)(gm, example_inputs)


def _case(method, *, packed, window, sinks, backend, fullgraph):
    """On one rank: eager vs compiled block on this rank's shard; returns (worst error, compile s)."""
    import time

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    n = dist.get_world_size()
    cu = torch.tensor(DOCS, dtype=torch.int32) if packed else None
    gen = torch.Generator().manual_seed(3)
    x_global = torch.randn(B, T_GLOBAL, DIM, generator=gen)
    dy_global = torch.randn(B, T_GLOBAL, DIM, generator=gen)
    x, dy = (seqpar.shard(t, method=method, cu_seqlens=cu) for t in (x_global, dy_global))
    block = Block(method, window=window, sinks=sinks, cu_seqlens=cu)
    y_ref, g_ref = _run(block, x, dy)
    recorder = _Recorder(backend)
    compiled = torch.compile(block, backend=recorder, fullgraph=fullgraph)
    start = time.perf_counter()
    y, g = _run(compiled, x, dy)
    seconds = time.perf_counter() - start
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs: the block was split"
    assert "seqpar.attention_fwd" in recorder.graphs[0], "seqpar.attention is not in the compiled graph"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip([y] + g, [y_ref] + g_ref)]
    y2, _ = _run(compiled, x, dy)  # a second call runs the compiled code without compiling again
    assert len(recorder.graphs) == 1 and torch.equal(y2, y)
    if backend == "aot_eager":  # the fake implementation's shapes, strides and dtypes are the real ones'
        _opcheck(block, x, recorder.keys[0])
    return max(errs), seconds, n


def _opcheck(block, x, constants):
    b, t, _ = x.shape
    q = (x @ block.wq).view(b, t, HQ, D).detach().requires_grad_()
    k = (x @ block.wk).view(b, t, HKV, D).detach().requires_grad_()
    v = (x @ block.wv).view(b, t, HKV, D).detach().requires_grad_()
    sinks = None if block.sinks is None else block.sinks.detach().requires_grad_()
    torch.library.opcheck(torch.ops.seqpar.attention_fwd.default, (q, k, v, sinks, block.cu_seqlens, *constants),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _recorders():
    """CommStats, seqpar.trace and seqpar.checkpoint around a compiled block: the same bytes, the
    same trace events and the same gradients as eager; under seqpar.checkpoint the attention forward
    runs once (its bytes are counted once). Then ranks that pass different arguments to a compiled
    call raise ValueError on every rank (the agreement runs inside the op)."""
    from seqpar.comm import CommStats

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)
    x, dy = (seqpar.shard(torch.randn(B, T_GLOBAL, DIM, generator=gen), method="zigzag_ring") for _ in range(2))
    runs = {}
    for compiled in (False, True):
        for checkpointed in (False, True):
            stats, rec = CommStats(), seqpar.Trace()
            block = Block("zigzag_ring", stats=stats)
            fn = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
            if checkpointed:
                fn = (lambda inner: lambda t: seqpar.checkpoint(inner, t))(fn)
            with seqpar.trace(rec):
                y, grads = _run(fn, x, dy, block.parameters())
            kinds = [(e["type"], e.get("name"), e.get("phase")) for e in rec.events]
            runs[compiled, checkpointed] = (y, grads, dict(stats.sent), kinds)
    y, grads, sent, _ = runs[False, False]
    assert sent
    for (compiled, checkpointed), (y2, grads2, sent2, kinds2) in runs.items():
        name = f"compiled={compiled}, checkpointed={checkpointed}"
        assert torch.equal(y2, y) and all(torch.equal(a, b) for a, b in zip(grads2, grads)), name
        assert sent2 == sent, f"{name}: bytes {sent2} != eager {sent} (checkpointing must not repeat the forward)"
        assert kinds2 == runs[False, checkpointed][3], f"{name}: trace events differ from eager"
    # the rank agreement runs inside the compiled op: ranks that disagree all raise, naming the argument
    q, k, v = (seqpar.shard(torch.randn(1, T_GLOBAL, h, D, generator=gen), method="zigzag_ring")
               for h in (HQ, HKV, HKV))
    causal = dist.get_rank() == 0
    disagree = torch.compile(lambda q, k, v: seqpar.attention(q, k, v, causal=causal), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(ValueError, match="causal"):
        disagree(q, k, v)
    return True


def _shard_mesh_unshard():
    """Inside compiled code: seqpar.shard (local indexing) compiles with fullgraph=True; attention
    over a 1-D DeviceMesh compiles and equals eager; seqpar.unshard (a collective) runs between two
    graphs with fullgraph=False and raises naming the reason with fullgraph=True."""
    from torch.distributed.device_mesh import init_device_mesh

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, T_GLOBAL, HQ, D, generator=gen)
    torch._dynamo.reset()
    local = torch.compile(lambda t: seqpar.shard(t, method="zigzag_ring") * 2, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(local, seqpar.shard(x, method="zigzag_ring") * 2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    attend = lambda q: seqpar.attention(q, q, q, group=mesh, causal=True)  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, backend="aot_eager", fullgraph=True)(local), attend(local))
    torch._dynamo.reset()
    gather = lambda t: seqpar.unshard(t * 3, method="zigzag_ring") + 1  # noqa: E731
    assert torch.equal(torch.compile(gather, backend="aot_eager")(local), x * 6 + 1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unshard runs outside"):
        torch.compile(gather, backend="aot_eager", fullgraph=True)(local)
    return True


def _dynamic_lengths():
    """Three sequence lengths through one compiled call (Dynamo recompiles once with a symbolic
    length): each equals eager, forward and dq (Ulysses, 3 heads: uneven head shards)."""
    torch._dynamo.reset()
    fn = lambda q, k, v: seqpar.attention(q, k, v, causal=True, method="ulysses")  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for t in (12, 24, 36):
        gen = torch.Generator().manual_seed(t)
        q, k, v = (seqpar.shard(torch.randn(1, t, 3, D, generator=gen), method="ulysses") for _ in range(3))
        (y, (gq,)), (y_ref, (gq_ref,)) = ((lambda out: (out, torch.autograd.grad(out.sum(), [q])))(
            f(q.requires_grad_(), k, v)) for f in (compiled, fn))
        assert torch.equal(y, y_ref) and torch.equal(gq, gq_ref), f"T={t}"
    return True


def _after_cases():
    return _recorders() and _shard_mesh_unshard() and _dynamic_lengths()


def _cases(cases, backend, fullgraph):
    rows = []
    for c in cases:
        try:
            rows.append((c, *_case(c[0], packed=c[1], window=c[2], sinks=c[3], backend=backend, fullgraph=fullgraph)))
        except Exception as exc:
            raise AssertionError(f"case {c} ({backend}, fullgraph={fullgraph}): {type(exc).__name__}: {exc}") from exc
    return rows


def _fresh(world, cases, backend, fullgraph, timeout, then=None):
    """Run ``cases`` in a new pool of ``world`` processes (never one that compiled before), then
    ``then()`` on every rank of the same pool (which must return True)."""
    pool = WorkerPool(world)
    try:
        rows = pool.run(_cases, (cases, backend, fullgraph), {}, timeout=timeout)
        if then is not None:
            assert all(pool.run(then, (), {}, timeout=timeout))
        return rows
    finally:
        pool.close(kill=True)


def _check(results):
    for rank, rows in enumerate(results):
        for case, err, seconds, _ in rows:
            assert err <= FP32_COMPILED, f"rank {rank} {case}: compiled vs eager error {err:.2e}"


def _llama_case(method, packed, backend):
    """A 2-layer Llama converted with apply_context_parallel, each decoder layer compiled
    (``fullgraph=True``): loss, logits and every gradient equal the same converted model in eager mode.
    Returns (worst error, compile seconds)."""
    import copy
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations.hf import apply_context_parallel, context_parallel_loss, shard_inputs

    torch._dynamo.reset()
    torch.manual_seed(5)
    # 3 query heads on 1 KV head: Ulysses gives the ranks different head counts (2, 1 at N = 2), so
    # the ranks' graphs differ (a graph cached on disk by one rank must not serve another)
    config = LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    eager = apply_context_parallel(LlamaForCausalLM(config), method=method)
    compiled = copy.deepcopy(eager)
    recorders = []
    for layer in compiled.model.layers:
        recorders.append(_Recorder(backend))
        layer.compile(backend=recorders[-1], fullgraph=True)
    ids = torch.randint(0, 64, (1, T_GLOBAL), generator=torch.Generator().manual_seed(11))
    cu = torch.tensor(DOCS, dtype=torch.int32) if packed else None
    batch = shard_inputs(ids, cu_seqlens=cu, method=method)
    results, seconds = [], 0.0
    for model in (eager, compiled):
        start = time.perf_counter()
        logits = model(**batch.model_kwargs()).logits
        loss = context_parallel_loss(logits, batch.labels)
        loss.backward()
        seconds = time.perf_counter() - start
        results.append([logits.detach(), loss.detach()] + [p.grad for p in model.parameters()])
    for rec in recorders:
        assert rec.graphs and all("seqpar.attention_fwd" in g for g in rec.graphs), "a layer was not compiled"
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(results[1], results[0])), seconds


def _inductor_cases(cases, llama):
    """Inductor, in one fresh process per rank: the block at ``fullgraph=False``, then the Llama layers."""
    torch._inductor.config.compile_threads = 1  # 2 cores: a pool of compile workers costs more than it saves
    rows = _cases(cases, "inductor", False)
    if llama:
        rows.append((("llama", *llama), *_llama_case(*llama, "inductor"), dist.get_world_size()))
    return rows


def _fresh_inductor(world, cases, llama, timeout):
    pool = WorkerPool(world)
    try:
        return pool.run(_inductor_cases, (cases, llama), {}, timeout=timeout)
    finally:
        pool.close(kill=True)


ALL = ("ring", "zigzag_ring", "striped_ring", "allgather_kv", "token_ring", "lightseq", "ulysses", "usp")
# (method, packed, window, sinks); N = 3 splits the 4 query heads unevenly (Ulysses: 2, 1, 1)
DENSE = [(m, False, None, False) for m in ALL]
PACKED = [(m, True, None, False) for m in ALL]
OPTIONS = [("zigzag_ring", False, 5, False), ("ulysses", True, 4, False), ("ring", False, None, True),
           ("usp", True, None, True)]


@pytest.mark.parametrize("n, cases", [(2, DENSE + OPTIONS[:2]), (3, PACKED + OPTIONS[2:])], ids=["n2-dense", "n3-packed"])
def test_every_method_aot_eager(n, cases):
    """Every method, dense at N = 2 and packed at N = 3, a window and sinks: fullgraph=True; then
    (same processes, N = 2) stats, trace and seqpar.checkpoint around a compiled block, the rank
    agreement, unshard between two graphs, shard, a DeviceMesh group, and sequence lengths that
    change between calls (seqpar.linear_attention: tests/test_compile_linear.py)."""
    _check(_fresh(n, cases, "aot_eager", True, timeout=600, then=_after_cases if n == 2 else None))


def test_inductor_block_and_llama_layers():
    """Inductor: the block (zigzag_ring, fullgraph=False) and a converted Llama compiled per layer
    (fullgraph=True, packed documents, usp), in one fresh pair of processes."""
    _check(_fresh_inductor(2, [("zigzag_ring", False, None, False)], ("usp", True), timeout=900))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_every_method_inductor(n, fullgraph):
    """The whole matrix under Inductor (slow: see the module docstring)."""
    _check(_fresh(n, DENSE + PACKED + OPTIONS, "inductor", fullgraph, timeout=3000))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("method", ALL)
def test_llama_layers_inductor(n, method):
    _check(_fresh_inductor(n, [], (method, n == 3), timeout=900))
