"""The architecture holds (docs/architecture.md): layers and the test-harness ban (import-linter), no
import cycles anywhere (grimp, imports inside functions included), one method vocabulary that every
consumer agrees with, file and function sizes, schedule-derived cost terms, and a toy ring variant
that works dense and packed by adding only its plan and its declaration."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from dist_utils import FP32_TOL, global_inputs, reference_grads, rel_err
from seqpar import methods
from seqpar.methods import DECLARED, Method
from seqpar.softmax.plans import Block, RingPlan, ring_plan, verify
from seqpar.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "seqpar"


# ----------------------------------------------------------------------------- imports


def test_import_contracts_are_kept():
    """Layers (kernels/comm < layouts < softmax/linear < schedulers < integrations/bench < cli) and no
    library module importing seqpar.testing: the contracts of pyproject.toml, by import-linter."""
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("seqpar", include_external_packages=False)
    assert _cycles(graph) == []


# ----------------------------------------------------------------------------- sizes


def test_library_files_and_functions_are_small():
    """No library file over 450 lines, no function over 80 (docs/CONTRIBUTING_NOTES.md)."""
    long_files, long_functions = [], []
    for path in sorted(LIBRARY.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 450:
            long_files.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert long_files == [] and long_functions == []


# ----------------------------------------------------------------------------- one vocabulary


def test_every_consumer_agrees_with_the_method_declarations():
    import seqpar
    from seqpar.bench.suite import METHOD_GROUPS
    from seqpar.integrations.train.config import build_parser
    from seqpar.layouts import LAYOUTS, placement
    from seqpar.linear.plans import PLANS, resolve_plan
    from seqpar.schedulers import KNOWN_METHODS, LINEAR_METHODS, SOFTMAX_METHODS, ClusterSpec, CostModel
    from seqpar.schedulers.cost_comm import method_buffers
    from seqpar.softmax.registry import plan_builder

    names = [m.name for m in DECLARED]
    assert len(set(names)) == len(names)
    assert seqpar.METHODS == methods.METHODS == tuple(m.name for m in DECLARED if m.family != "linear")
    assert seqpar.LINEAR_METHODS == methods.LINEAR_METHODS == tuple(m.name for m in DECLARED if m.family == "linear")
    assert set(KNOWN_METHODS) == set(names) and set(SOFTMAX_METHODS) == set(methods.METHODS)
    assert LINEAR_METHODS == tuple(n for n in KNOWN_METHODS if n in methods.LINEAR_METHODS)
    assert METHOD_GROUPS["all"] == methods.ALL_METHODS and METHOD_GROUPS["linear"] == methods.LINEAR_METHODS
    cp_method = next(a for a in build_parser()._actions if a.dest == "cp_method")
    assert tuple(cp_method.choices) == methods.METHODS
    cost, cluster = CostModel.default(), ClusterSpec.h100(16)
    for m in DECLARED:
        assert m.layout == "usp" or m.layout in LAYOUTS
        assert placement(m.name, None).method == m.name
        method_buffers(m.name, 4096, 1024, 32, 2)  # every buffer trait has a formula
        assert cost.comm_parts(m.name, 8, cluster)[0], f"{m.name}: no communication modelled"
        if m.family == "ring":
            assert callable(plan_builder(m))
        if m.family == "linear":
            assert resolve_plan(m.name) is PLANS[m.plan]
    assert set(PLANS) == {m.plan for m in DECLARED if m.family == "linear"}
    readme = (ROOT / "README.md").read_text()
    for m in DECLARED:  # the README's method tables list every method
        assert re.search(rf"^\| `{m.name}`", readme, re.M), f"README.md has no table row for {m.name}"


def test_declared_balance_matches_the_schedules():
    """``causal_balanced`` is what the schedules compute: every rank the same causal work at every N
    (lightseq balances odd N only)."""
    from seqpar.softmax.registry import dense_plan

    for m in DECLARED:
        if m.family != "ring":
            continue
        works = [[dense_plan(m, r, n, 8, True).work(8) for r in range(n)] for n in (2, 3, 4, 5)]
        assert all(max(w) == min(w) for w in works) == m.causal_balanced, (m.name, works)


def test_cost_model_coefficients_are_what_the_schedules_do():
    """The cost model's schedule-dependent terms (causal imbalance; the busiest rank's bytes of
    token_ring and lightseq), read from the replayed-trace table, equal what the methods' own
    schedules compute, counted here directly from their moves and blocks."""
    from seqpar.schedulers.replay_table import causal_imbalance, schedule_bytes
    from seqpar.softmax.plans import WIRES
    from seqpar.softmax.registry import dense_plan

    hq, hkv, d, e, acc, t = 4, 2, 8, 2, 4, 4
    for m in DECLARED:
        if m.family != "ring" or m.transport != "p2p":
            continue
        for n in (2, 4, 8):
            work = [dense_plan(m, r, n, t, True).work(t) for r in range(n)]
            assert causal_imbalance(m.name, n) == pytest.approx(max(work) * n / sum(work)), (m.name, n)
            if m.comm != "schedule":
                continue
            sent = []
            for r in range(n):
                total = 0
                for step in dense_plan(m, r, n, t, True).schedule(t).steps:
                    for mv in (x for x in step.moves if x.send):
                        rows = mv.rows.stop - mv.rows.start
                        for bwd in (False, True):
                            for w in WIRES.get((mv.what, bwd), ()):
                                per = (1 if w.stat else d) * (hq if w.heads == "q" else hkv) * len(w.parts)
                                total += rows * per * {"input": e, "acc": 4, "grad": acc}[w.dtype]
                sent.append(total)
            assert schedule_bytes(m.name, n, hq, hkv, d, e, acc) == pytest.approx(max(sent) / t), (m.name, n)


def test_the_replayed_coefficient_table_is_current():
    """seqpar/schedulers/replay_coeffs.json is what ``python -m seqpar.bench.replay_coeffs`` writes now
    (checked on the small groups; regenerate it when a schedule changes)."""
    import json

    from seqpar.bench.replay_coeffs import table
    from seqpar.schedulers.replay_table import TABLE

    stored = json.loads(TABLE.read_text())
    fresh = table((2, 4, 8), progress=False)
    for name, entry in fresh["methods"].items():
        for field in ("imbalance", "rows"):
            for d, value in entry[field].items():
                got = stored["methods"][name][field][d]
                if field == "rows":  # the ranks no other dominates: lists of five coefficients
                    got, value = [v for row in got for v in row], [v for row in value for v in row]
                assert got == pytest.approx(value), (name, field, d)


# ----------------------------------------------------------------------------- a toy ring variant


def halves_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> RingPlan:
    """The contiguous ring with every block cut into two query halves (and the causal diagonal into
    three blocks): a new variant is a plan, nothing else."""
    h = t_local // 2
    top, bottom = slice(0, h), slice(h, t_local)
    steps = []
    for blocks in ring_plan(rank, n, t_local, causal, transport).steps:
        cut = []
        for b in blocks:
            if b.mask == "none":
                cut += [Block(top, b.kv, "none"), Block(bottom, b.kv, "none")]
            else:
                cut += [Block(top, top, "causal"), Block(bottom, top, "none"), Block(bottom, bottom, "causal")]
        steps.append(tuple(cut))
    return RingPlan(tuple(steps), transport)


TOY = Method("toy_halves", family="ring", layout="contiguous", transport="p2p",
             plan="test_architecture:halves_plan", comm="kv_ring", buffers="kv_double", preference=99,
             causal_balanced=False, summary="a test's ring variant: ring blocks cut in halves")


@pytest.mark.parametrize("causal", (True, False))
def test_toy_plan_verifies(causal):
    verify(halves_plan, 3, 6, causal, "contiguous")


def _toy_case(causal: bool, packed: bool):
    import seqpar
    from seqpar import methods as vocab

    declared = vocab.DECLARED
    vocab.DECLARED = declared + (TOY,)  # the declaration a new variant adds (restored below)
    try:
        T, cu = (24, None) if not packed else (23, torch.tensor([0, 1, 9, 10, 23], dtype=torch.int32))
        low, ref = global_inputs(1, T, 4, 2, 8, 11, torch.float32)
        want = reference_grads(*ref, causal, cu_seqlens=cu)
        q, k, v, dout = (seqpar.shard(t, method="toy_halves", cu_seqlens=cu) for t in low)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = seqpar.attention(q, k, v, method="toy_halves", causal=causal, cu_seqlens=cu)
        out.backward(dout)
        got = [seqpar.unshard(t, method="toy_halves", cu_seqlens=cu) for t in (out.detach(), q.grad, k.grad, v.grad)]
        return [rel_err(g, w) for g, w in zip(got, want)]
    finally:
        vocab.DECLARED = declared


@pytest.mark.parametrize("packed", (False, True), ids=("dense", "packed"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_toy_ring_variant_runs_dense_and_packed(causal, packed):
    """Declared in a test and planned by ``halves_plan``: exact forward and gradients at N = 3."""
    for rank, errs in enumerate(run_distributed(_toy_case, 3, causal, packed, timeout=120)):
        assert max(errs) <= FP32_TOL, f"rank {rank}: errors (out, dq, dk, dv) {errs}"


def test_a_method_declaration_is_checked():
    with pytest.raises(ValueError, match="plan='module:function'"):
        dataclasses.replace(TOY, plan=None)
    with pytest.raises(ValueError, match="layout='diagonal'"):
        dataclasses.replace(TOY, layout="diagonal")
    assert inspect.signature(halves_plan).parameters.keys() == inspect.signature(ring_plan).parameters.keys()
