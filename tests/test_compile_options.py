"""Options created inside a compiled function (``seqpar.attention`` / ``seqpar.linear_attention``
under ``torch.compile``).

The compiled ops find a call's non-tensor options (``stats``, ``trace``, ...) through a registry
filled while Dynamo traces (:mod:`seqpar.opregistry`). A ``CommStats`` or ``Trace`` constructed inside
the traced function reaches the registry as a stand-in whose attributes were never set, and the object
the function returns is another one: nothing could be counted into it. Such a call must raise a
``ValueError`` that names the option and says to create it outside; the same object created outside
keeps counting the bytes eager mode counts (the positive control, so the check is not simply
rejecting every CommStats).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.stats import CommStats
from seqpar.opregistry import made_while_tracing
from seqpar.testing import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs():
    torch.manual_seed(dist.get_rank())
    shape = (1, 8, 2, 4)
    return tuple(torch.randn(shape, requires_grad=True) for _ in range(3))


def _call(linear: bool, q, k, v, **options):
    if linear:
        return seqpar.linear_attention(q, k, v, group=dist.group.WORLD, method="lasp2", **options)[0]
    return seqpar.attention(q, k, v, group=dist.group.WORLD, method="zigzag_ring", causal=True, **options)


def _inside(linear: bool, fullgraph: bool) -> str:
    """The error of a compiled call whose ``CommStats`` is created inside the function."""
    torch._dynamo.reset()

    def block(q, k, v):
        stats = CommStats()
        return _call(linear, q, k, v, stats=stats).sum(), stats

    try:
        torch.compile(block, backend="aot_eager", fullgraph=fullgraph)(*_inputs())
    except Exception as exc:  # Dynamo wraps the ValueError raised at trace time
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _outside(linear: bool) -> tuple[list, list]:
    """Bytes counted by a new CommStats passed in at each of 2 calls, compiled and eager."""
    torch._dynamo.reset()
    counted = []
    for compiled in (True, False):
        def block(q, k, v, stats):
            return _call(linear, q, k, v, stats=stats).sum()

        fn = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
        per_call = []
        for _ in range(2):
            stats = CommStats()
            fn(*_inputs(), stats).backward()
            per_call.append(dict(stats.sent))
        counted.append(per_call)
    return counted[0], counted[1]


def _trace_inside(linear: bool) -> list[int]:
    """Events recorded into a Trace created inside the compiled function (Dynamo cannot trace its
    constructor, so it breaks the graph there and the Trace is a real object): one count per call."""
    torch._dynamo.reset()

    def block(q, k, v):
        recorder = seqpar.Trace()
        return _call(linear, q, k, v, trace=recorder).sum(), recorder

    fn = torch.compile(block, backend="aot_eager")
    counts = []
    for _ in range(2):
        _out, recorder = fn(*_inputs())
        counts.append(len(recorder.events))
    return counts


def _check(linear: bool):
    errors = {fg: _inside(linear, fg) for fg in (True, False)}
    return errors, _outside(linear), _trace_inside(linear)


@pytest.mark.parametrize("linear", [False, True], ids=["attention", "linear_attention"])
def test_option_created_inside_compiled_function_raises(linear):
    results = run_distributed(_check, 2, linear, timeout=240)
    for errors, (compiled, eager), traced in results:
        for fullgraph, message in errors.items():
            assert "ValueError: stats: this CommStats is created inside" in message, (fullgraph, message)
            assert "create it before the compiled function" in message, message
        assert compiled == eager and all(sum(c.values()) > 0 for c in eager), (compiled, eager)
        assert traced[0] == traced[1] > 0, traced


def test_made_while_tracing_only_flags_unset_seqpar_objects():
    assert not made_while_tracing(CommStats()) and not made_while_tracing(seqpar.Trace())
    assert made_while_tracing(CommStats.__new__(CommStats))
    assert made_while_tracing((1, seqpar.Trace.__new__(seqpar.Trace)))

    class Empty:  # not a seqpar object (a user's, a group): never flagged
        pass

    assert not made_while_tracing(Empty()) and not made_while_tracing(None) and not made_while_tracing(3)
