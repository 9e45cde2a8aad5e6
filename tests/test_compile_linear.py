"""``seqpar.linear_attention`` inside ``torch.compile`` (seqpar.linear.compiled): compiled == eager.

A small block around the call (a scaled query, a sine of the output) is compiled with
``fullgraph=True`` per case on gloo ranks. Under ``aot_eager`` the block runs the same aten ops as
eager mode around the same opaque op, so its output, final state and every input gradient (q, k, v,
g, initial_state) must equal eager mode's bit for bit, and so must the bytes each rank sent
(``CommStats``) and the events a ``seqpar.Trace`` recorded. The compiled result is also checked
against a float64 token-by-token recurrence on the whole sequence (seqpar.linear.reference): the
states are computed in fp32 in another order than the recurrence, which gives ~1e-6 relative error;
a wrong incoming state, decay or document reset gives ~1e-1. ``FP32`` allows 2e-5.

Every compile is verified to have happened: the test's Dynamo backend records each graph, and a case
passes only when exactly one graph was compiled, it contains ``seqpar.linear_attention_fwd`` and
Dynamo counted no graph break (a frame Dynamo gave up on runs eagerly and would look like a success).
Dynamo is reset before every case, so no case reuses another's compile.

Default cases (each option a user can pass appears at least once): every method at N = 2, LASP-2
and ZeCO at N = 3 (the gathered decays' shape depends on N; a DeviceMesh group), decay per key
channel, per head and none, initial and final state, packed documents with ``cu_seqlens`` as a
tensor and as a list, ``scale``, backends ``torch`` and ``triton`` (the Triton interpreter on CPU),
Inductor once (its first compile in a process costs most of a test's time), bad input, and local
lengths that change between calls. ``@pytest.mark.slow``: every method at N = 2, 3, 4 over every
combination of decay, initial/final state and packing, and Triton dense and packed (measured at load
average ~9: 66 s for one method at N = 2, 121 s at N = 3, 98 s at N = 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.comm.stats import CommStats
from seqpar.linear import reference_linear_attention
from seqpar.testing import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = 2e-5  # compiled fp32 against the float64 recurrence (module docstring)
FP32_INDUCTOR = 2e-6  # Inductor against eager: it may fuse and reorder the fp32 ops around the op
H, K, V = 2, 4, 3


class _Recorder:
    """A Dynamo backend that records every graph it compiles, then hands it to ``backend``."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm.code)
        self.constants = [n.args[-3:] for n in gm.graph.nodes if "linear_attention_fwd" in str(n.target)]
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.backend)(gm, example_inputs)


def _spec(method, *, n=2, b=1, t_local=6, g="k", h0=True, final=True, cu=None, backend=None, scale=None,
          mesh=False, compiler="aot_eager", seed=0):
    return dict(method=method, n=n, B=b, T_local=t_local, g=g, h0=h0, final=final, cu=cu, backend=backend,
                scale=scale, mesh=mesh, compiler=compiler, seed=seed)


def _inputs(spec):
    """The global problem in float64 (the same on every process): q, k, v, g, h0 and the loss weights."""
    gen = torch.Generator().manual_seed(spec["seed"])
    b, t = spec["B"], spec["n"] * spec["T_local"]
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": rnd(b, t, H, K), "k": rnd(b, t, H, K), "v": rnd(b, t, H, V)}
    if spec["g"] == "k":  # per key channel
        x["g"] = F.logsigmoid(rnd(b, t, H, K) + 2)
    elif spec["g"] == "h":  # one per head
        x["g"] = F.logsigmoid(rnd(b, t, H) + 2)
    if spec["h0"]:
        x["h0"] = rnd(1 if spec["cu"] else b, H, K, V)
    x["W"] = rnd(b, t, H, V)  # d loss / d (sin o)
    x["U"] = rnd(1 if spec["cu"] else b, H, K, V)  # d loss / d final state (every rank's copy)
    return x


def _block(spec, group, stats):
    """The function that is compiled: a call of seqpar.linear_attention between two pointwise ops."""
    cu = spec["cu"]
    cu = torch.tensor(cu, dtype=torch.int32) if isinstance(cu, tuple) else cu  # a tuple: pass a tensor

    def block(q, k, v, g, h0):
        o, ht = seqpar.linear_attention(q * 1.5, k, v, g, group=group, method=spec["method"], scale=spec["scale"],
                                        initial_state=h0, output_final_state=spec["final"], cu_seqlens=cu,
                                        stats=stats, backend=spec["backend"])
        return o.sin(), ht
    return block


def _run(fn, leaves, x, rows):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    y, ht = fn(*leaves)
    loss = (y.double() * x["W"][:, rows]).sum()
    if ht is not None:
        loss = loss + (ht.double() * x["U"]).sum()
    loss.backward()
    return [y.detach(), None if ht is None else ht.detach()] + [None if t is None else t.grad for t in leaves]


def _case(spec):
    """On one rank: the block eager and compiled on this rank's shard; returns the compiled results."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _inputs(spec)
    t = spec["T_local"]
    rows = slice(rank * t, (rank + 1) * t)
    leaves = [x[name][:, rows].float() for name in ("q", "k", "v")]
    leaves += [x["g"][:, rows].float() if "g" in x else None, x["h0"].float() if "h0" in x else None]
    group = None
    if spec["mesh"]:
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    runs = []
    for compiled in (False, True):
        stats, rec = CommStats(), seqpar.Trace()
        fn = _block(spec, group, stats)
        if compiled:
            recorder = _Recorder(spec["compiler"])
            fn = torch.compile(fn, backend=recorder, fullgraph=spec["compiler"] == "aot_eager")
        with seqpar.trace(rec):
            got = _run(fn, leaves, x, rows)
        runs.append((got, dict(stats.sent), [(e["type"], e.get("name"), e.get("phase")) for e in rec.events]))
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs: the block was split"
    assert "seqpar.linear_attention_fwd" in recorder.graphs[0], "seqpar.linear_attention is not in the graph"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    (eager, sent, events), (comp, sent_c, events_c) = runs
    assert sent_c == sent and sent, f"bytes {sent_c} != eager {sent}"
    assert events_c == events, "trace events differ from eager"
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
    for name, a, b in zip(names, comp, eager):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if spec["compiler"] == "aot_eager":
            assert torch.equal(a, b), f"{name}: compiled != eager (max diff {float((a - b).abs().max()):.2e})"
        else:
            err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            assert err <= FP32_INDUCTOR, f"{name}: Inductor vs eager {err:.2e}"
    if spec["compiler"] == "aot_eager":  # the fake implementation's shapes, strides and dtypes are the real ones'
        _opcheck(spec, leaves, recorder.constants[0])
    return dict(zip(names, comp))


def _opcheck(spec, leaves, constants):
    cu = spec["cu"]
    cu = torch.tensor(cu, dtype=torch.int32) if isinstance(cu, tuple) else None
    args = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    args[0] = args[0] * 1.5  # the block's scaled query
    torch.library.opcheck(torch.ops.seqpar.linear_attention_fwd.default, (*args, cu, *constants),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _reference(spec, x):
    """The block on the whole sequence in float64: output, final state and every gradient."""
    names = [n for n in ("q", "k", "v", "g", "h0") if n in x]
    ins = {n: x[n].float().double().requires_grad_() for n in names}  # the ranks' fp32 inputs, exactly
    o, ht = reference_linear_attention(ins["q"] * 1.5, ins["k"], ins["v"], ins.get("g"), scale=spec["scale"],
                                       initial_state=ins.get("h0"), cu_seqlens=list(spec["cu"] or []) or None)
    y = o.sin()
    loss = (y * x["W"]).sum() + (spec["n"] * (ht * x["U"]).sum() if spec["final"] else 0)
    grads = torch.autograd.grad(loss, [ins[n] for n in names])
    return {"o": y.detach(), "ht": ht.detach(), **{"d" + n: gr for n, gr in zip(names, grads)}}


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check(spec, res):
    """Every rank's compiled results against the float64 reference (the eager equality is checked on
    the ranks); d initial_state is summed over the ranks (it comes out on the first rank)."""
    ref = _reference(spec, _inputs(spec))
    for name in ("o", "dq", "dk", "dv", "dg"):
        if name in ref:
            err = _rel(torch.cat([r[name] for r in res], 1), ref[name])
            assert err <= FP32, f"{name}: error {err:.2e} against float64"
    if spec["final"]:
        assert all(_rel(r["ht"], ref["ht"]) <= FP32 for r in res), "final state against float64"
    if spec["h0"]:
        assert _rel(sum(r["dh0"] for r in res), ref["dh0"]) <= FP32, "d initial_state against float64"


def _cases(specs):
    return [_case(spec) for spec in specs]


N2 = {
    "zeco-gK-h0-final-B2": _spec("zeco", b=2),
    "lasp2-gH-packed-tensor-h0-final": _spec("lasp2", g="h", cu=(0, 1, 7, 12)),
    "lasp1-nog-nofinal-triton-scale": _spec("lasp1", g=None, h0=False, final=False, backend="triton", scale=0.4),
}
N3 = {
    "zeco-gK-packed-list-h0-final": _spec("zeco", n=3, t_local=5, cu=[0, 5, 6, 11, 15]),
    "lasp2-gK-mesh-nofinal-B2": _spec("lasp2", n=3, b=2, final=False, mesh=True),
}


def _check_named(specs: dict, results: list) -> None:
    """:func:`_check` on every case of ``specs`` (name -> spec) against the ranks' ``results``."""
    for i, (name, spec) in enumerate(specs.items()):
        try:
            _check(spec, [r[i] for r in results])
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.parametrize("n, cases", [(2, N2), (3, N3)], ids=["n2", "n3"])
def test_compiled_equals_eager_and_reference(n, cases):
    """fullgraph=True under aot_eager: compiled == eager exactly (forward, final state, every input
    gradient, bytes, trace events) and within fp32 rounding of the float64 recurrence."""
    _check_named(cases, run_distributed(_cases, n, list(cases.values()), timeout=600))


def _bad_inputs():
    """Under compile, bad input raises eager's ValueError on every rank: a positive decay on rank 1
    only (the rank agreement inside the op turns it into an error on every rank), and k's shape
    unlike q's on every rank."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(1, 4, H, K, generator=gen)
    bad_g = g.abs() if rank == 1 else g
    fn = lambda q, k, v, g: seqpar.linear_attention(q, k, v, g, method="zeco")[0]  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, g), fn(q, k, v, g))
    messages = []
    for args in ((q, k, v, bad_g), (q, k[..., :3], v, g)):
        errors = []
        for f in (fn, compiled):
            with pytest.raises(ValueError) as info:
                f(*args)
            errors.append(str(info.value))
        assert errors[0] == errors[1], f"compiled raised {errors[1]!r}, eager {errors[0]!r}"
        messages.append(errors[1])
    return messages


def test_bad_input_raises_eager_error_under_compile():
    per_rank = run_distributed(_bad_inputs, 2, timeout=300)
    for rank, messages in enumerate(per_rank):
        assert "g: the log-decay must be <= 0" in messages[0], messages[0]
        assert rank == 1 or "rank(s) [1] rejected their arguments" in messages[0], messages[0]
        assert messages[1].startswith("k: shape (1, 4, 2, 3) must equal q's"), messages[1]


def test_inductor():
    """Inductor (fullgraph=False): one method, compiled within fp32 rounding of eager and of float64."""
    spec = _spec("zeco", compiler="inductor", g="h")
    torch_threads = run_distributed(_inductor_case, 2, spec, timeout=600)
    _check(spec, torch_threads)


def _inductor_case(spec):
    torch._inductor.config.compile_threads = 1  # 2 cores: a pool of compile workers costs more than it saves
    return _case(spec)


def _dynamic_lengths():
    """Three local lengths through one compiled call (Dynamo recompiles once with a symbolic length):
    each equals eager, output, final state and every gradient (lasp2: the gathered decays' shape)."""
    torch._dynamo.reset()
    fn = lambda q, k, v, g: seqpar.linear_attention(q, k, v, g, method="lasp2", output_final_state=True)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for t in (3, 5, 8):
        gen = torch.Generator().manual_seed(t)
        x = [torch.randn(1, t, H, d, generator=gen) for d in (K, K, V)] + [-torch.rand(1, t, H, generator=gen)]
        runs = []
        for f in (fn, compiled):
            leaves = [a.clone().requires_grad_() for a in x]
            o, ht = f(*leaves)
            runs.append([o, ht, *torch.autograd.grad(o.sin().sum() + ht.sum(), leaves)])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), f"T_local={t}"
    return True


def test_changing_lengths_under_compile():
    assert all(run_distributed(_dynamic_lengths, 2, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("method", ["zeco", "lasp2", "lasp1"])
def test_every_method_and_option(n, method):
    """Every method with every combination of decay, initial/final state and packing (torch backend),
    and the Triton backend (interpreted on CPU: ~6 s a case) with and without packing."""
    packed = tuple(range(0, 5 * n, 4)) + (5 * n,)  # a document edge inside most shards
    specs = {f"g{g}-h0{h0}-final{final}-packed{cu is not None}": _spec(method, n=n, g=g, h0=h0, final=final,
                                                                       cu=cu, t_local=5)
             for g in ("k", "h", None) for h0 in (True, False) for final in (True, False) for cu in (None, packed)}
    specs.update({f"triton-packed{cu is not None}": _spec(method, n=n, cu=cu, t_local=5, backend="triton")
                  for cu in (None, packed)})
    _check_named(specs, run_distributed(_cases, n, list(specs.values()), timeout=3000))
