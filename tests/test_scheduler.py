"""Tests of the heterogeneity-adaptive planner (seqpar.schedulers): validity, optimality on small
instances against exhaustive search, baselines, bad input, serialisation, CLI. CPU only, < 60 s."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpar.schedulers import (ClusterSpec, CostModel, MethodCost, Plan, PlanAhead, best_static_plan,
                               fit_to_cluster, greedy_plan, local_batch, plan_batch, sample_lengths, static_plan)
from seqpar.schedulers.cli import plan_main
from seqpar.schedulers.milp import bucketize

CM = CostModel.default()


def _aligned_layouts(n: int):
    """Every partition of ranks [0, n) into aligned power-of-two blocks, as [(start, size), ...]."""
    def rec(start):
        if start == n:
            yield []
            return
        d = 1
        while start % d == 0 and start + d <= n:
            for rest in rec(start + d):
                yield [(start, d)] + rest
            d *= 2
    yield from rec(0)


def _brute_force(lens, cluster, cost_model, methods):
    """Optimal makespan by enumeration of layouts x assignments x methods, through the public
    CostModel API only (independent of the planner's tables). Size-1 groups use the first method,
    as the planner documents (one rank communicates nothing)."""
    best = math.inf
    for lay in _aligned_layouts(cluster.world_size):
        for assign in itertools.product(range(len(lay)), repeat=len(lens)):
            worst = 0.0
            for g, (_, d) in enumerate(lay):
                seqs = [lens[i] for i in range(len(lens)) if assign[i] == g]
                if not seqs:
                    continue
                options = methods[:1] if d == 1 else methods
                t = min((cost_model.time(m, d, seqs, cluster) for m in options if cost_model.supports(m, d)
                         and cost_model.memory(m, d, seqs) <= cluster.memory_per_rank), default=math.inf)
                worst = max(worst, t)
                if worst >= best:
                    break
            best = min(best, worst)
    return best


# ---------------------------------------------------------------------------------------- cluster/cost
def test_cluster_bandwidth_by_group_size():
    c = ClusterSpec.h100(world_size=32)
    assert c.bandwidth(8) == c.intra_node_bandwidth and c.bandwidth(16) == c.inter_node_bandwidth
    assert c.latency(2) == c.latency_intra and c.latency(32) == c.latency_inter
    assert c.group_sizes() == (1, 2, 4, 8, 16, 32) and c.aligned_blocks(16) == (0, 16)
    assert ClusterSpec(world_size=24).max_group_size == 16  # three nodes: groups up to 16


@pytest.mark.parametrize("kwargs, name", [
    ({"world_size": 12}, "world_size"), ({"world_size": 6}, "world_size"), ({"world_size": 0}, "world_size"),
    ({"world_size": 8, "ranks_per_node": 6}, "ranks_per_node"),
    ({"world_size": 8, "inter_node_bandwidth": 0.0}, "inter_node_bandwidth"),
    ({"world_size": 8, "memory_per_rank": -1.0}, "memory_per_rank"),
])
def test_cluster_rejects_what_groups_cannot_tile(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ClusterSpec(**kwargs)


def test_cost_single_rank_has_no_communication_and_empty_group_is_free():
    c = ClusterSpec.h100(8)
    m = CM.coeffs("zigzag_ring")
    s = [1000, 3000]
    want = m.beta1 + m.alpha2 * 4000 + m.alpha1 * (1000 ** 2 + 3000 ** 2)
    for method in ("zigzag_ring", "ulysses", "token_ring", "usp"):
        assert CM.time(method, 1, s, c) == pytest.approx(want, rel=1e-12)
    assert CM.time("ulysses", 8, [], c) == 0.0


def test_cost_ulysses_and_ring_formulas():
    c = ClusterSpec.h100(16)
    d, s = 16, 40000  # inter-node group
    h, hk, L, e = CM.hidden, CM.kv_hidden, CM.layers, CM.bytes_per_element
    m = CM.coeffs("ulysses")
    comp = m.alpha1 * s * s / d + m.alpha2 * s / d + m.beta1
    uly = (d - 1) / d * s / d * (2 * h + 2 * hk) * e * 2 * L / c.inter_node_bandwidth + 8 * L * c.latency_inter
    assert CM.time("ulysses", d, [s], c) == pytest.approx(comp + uly, rel=1e-12)
    # K,V (d-1) hops fwd and bwd + d hops of the dK,dV accumulators (input dtype by default: e)
    ring_comm = ((d - 1) / d * 2 * e + e) * s * 2 * hk * L / c.inter_node_bandwidth
    z = CM.coeffs("zigzag_ring")
    want = z.beta1 + 2 * (d - 1) * L * c.latency_inter + z.alpha2 * s / d + max(z.alpha1 * s * s / d, ring_comm)
    assert CM.time("zigzag_ring", d, [s], c) == pytest.approx(want, rel=1e-12)
    assert CM.time("ring", d, [s], c) > CM.time("zigzag_ring", d, [s], c)  # causal imbalance
    assert not CM.supports("ulysses", 64) and CM.supports("usp", 64)  # 32 heads


def test_ulysses_any_head_count_costs_its_head_imbalance():
    """9 query heads (SmolLM2-135M): ulysses runs on 2, 4 and 8 ranks (5+4, 3+2+2+2, 2+1x7), its
    attention term times max/mean heads; 16 ranks would leave ranks without a head. usp on 16 ranks
    of 8 per node shards heads over 8 with the same factor."""
    cm = CostModel.default(hidden=9 * 64, kv_hidden=3 * 64, layers=30, n_heads=9, ffn=1536, vocab=49152)
    cluster = ClusterSpec.h100(16)
    a1 = cm.coeffs("ulysses").alpha1
    for d, factor in ((2, 10 / 9), (4, 12 / 9), (8, 16 / 9)):
        assert cm.supports("ulysses", d)
        assert cm.group_coeffs("ulysses", d, cluster).quad == pytest.approx(a1 * factor / d, rel=1e-12)
    assert not cm.supports("ulysses", 16) and cm.supports("usp", 16)
    assert cm.group_coeffs("usp", 16, cluster).quad == pytest.approx(a1 * (16 / 9) / 16, rel=1e-12)
    assert cm.group_coeffs("zigzag_ring", 4, cluster).quad == pytest.approx(a1 / 4, rel=1e-12)
    lens = fit_to_cluster(sample_lengths(32, 5), cluster, cm, tokens_per_rank=16384)
    static_plan(lens, cluster, 4, "ulysses", cm).validate(lens, cluster, cm)  # refused before: 9 % 4


def test_cost_model_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "cm.json"
    CM.save(path)
    assert CostModel.load(path) == CM
    assert CostModel.from_json(CM.to_json()) == CM
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        CostModel.load(tmp_path / "bad.json")
    data = CM.to_dict()
    del data["methods"]["ulysses"]
    (tmp_path / "few.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"few\.json.*ulysses"):
        CostModel.load(tmp_path / "few.json", required=["zigzag_ring", "ulysses"])
    data = CM.to_dict()
    del data["methods"]["zigzag_ring"]["alpha1"]
    with pytest.raises(ValueError, match="zigzag_ring.*alpha1"):
        CostModel.from_dict(data, source="x")
    with pytest.raises(ValueError, match="alpha2"):
        MethodCost(alpha1=1.0, alpha2=-1.0, beta1=0.0, m_token=1.0, m_model=0.0)
    with pytest.raises(ValueError, match="no-such-file"):
        CostModel.load(tmp_path / "no-such-file.json")


# ---------------------------------------------------------------------------------------- planning
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 400_000), min_size=1, max_size=40),
       log_world=st.integers(0, 4), solver=st.sampled_from(["milp", "greedy"]))
def test_plans_are_valid(lens, log_world, solver):
    cluster = ClusterSpec(world_size=1 << log_world, ranks_per_node=4)
    try:
        plan = plan_batch(lens, cluster, time_limit=0.05, solver=solver)
    except ValueError as exc:  # only a batch too big for memory may be refused
        assert "fit" in str(exc)
        return
    plan.validate(lens, cluster, CM)
    assert plan.estimated_time == pytest.approx(max(g.estimated_time for g in plan.groups))
    assert plan.bound is None or plan.bound <= plan.estimated_time * (1 + 1e-9)
    for g in plan.groups:
        assert g.estimated_time == pytest.approx(CM.time(g.method, g.size, [lens[i] for i in g.seqs], cluster))


@pytest.mark.parametrize("seed", range(4))
def test_milp_never_worse_than_greedy(seed):
    cluster = ClusterSpec.h100(8)
    lens = fit_to_cluster(sample_lengths(int(12 + 8 * seed), seed), cluster, CM, tokens_per_rank=16384)
    greedy = greedy_plan(lens, cluster)
    plan = plan_batch(lens, cluster, time_limit=0.5)
    plan.validate(lens, cluster, CM)
    assert plan.estimated_time <= greedy.estimated_time * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in np.exp(rng.uniform(np.log(300), np.log(250_000), int(rng.integers(2, 7))))]
    cluster = ClusterSpec(world_size=4, ranks_per_node=2, inter_node_bandwidth=[5e9, 45e9][seed % 2])
    cm = CostModel.default(kv_hidden=[1024, 4096][seed % 3 == 0])
    plan = plan_batch(lens, cluster, cm, time_limit=None, mip_gap=0.0)
    plan.validate(lens, cluster, cm)
    assert plan.estimated_time == pytest.approx(_brute_force(lens, cluster, cm, list(cm.default_methods())),
                                                rel=1e-9)


def test_falls_back_to_greedy_without_scipy(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # "import scipy.optimize" now fails
    cluster = ClusterSpec(world_size=4, ranks_per_node=2)
    lens = [9000, 120_000, 3000, 3000, 47_000]
    plan = plan_batch(lens, cluster, mip_gap=0.0)
    plan.validate(lens, cluster, CM)
    assert plan.solver == "greedy" and ("scipy" in plan.notes or "MILP skipped" in plan.notes)


def test_long_tail_gets_mixed_group_sizes():
    # one long sequence and many short ones on 4 nodes, ring only: the planner gives the long one an
    # inter-node group and keeps short ones on small groups, beating every static degree (1.30x with
    # the default model's layer checkpointing; its recompute adds compute the communication hides under)
    cluster = ClusterSpec.h100(32)
    lens = [200_000] + [4_000] * 400
    plan = plan_batch(lens, cluster, methods=["zigzag_ring"])
    static = best_static_plan(lens, cluster, methods=["zigzag_ring"])
    assert len(plan.group_sizes()) > 1
    assert plan.estimated_time < static.estimated_time / 1.25


def test_static_plan():
    cluster = ClusterSpec.h100(16)
    lens = fit_to_cluster(sample_lengths(64, 3), cluster, CM, tokens_per_rank=16384)
    p = static_plan(lens, cluster, 4, "ulysses")
    p.validate(lens, cluster, CM)
    assert {(g.size, g.method) for g in p.groups} == {(4, "ulysses")} and len(p.groups) == 4
    best = best_static_plan(lens, cluster)
    assert best.estimated_time <= p.estimated_time
    assert plan_batch(lens, cluster).estimated_time <= best.estimated_time * (1 + 1e-12)
    with pytest.raises(ValueError, match="sp_degree"):
        static_plan(lens, cluster, 3, "ulysses")
    with pytest.raises(ValueError, match="sp_degree"):
        static_plan(lens, cluster, 32, "ulysses")
    with pytest.raises(ValueError, match="ulysses"):
        static_plan(lens, ClusterSpec.h100(64), 64, "ulysses")  # 32 heads


def test_static_plan_token_balanced():
    """balance="tokens" is the length-aware packer of static systems: longest first onto the group
    with the fewest tokens, blind to the quadratic attention cost that balance="time" sees."""
    cluster = ClusterSpec.h100(16)
    lens = [int(x) for x in fit_to_cluster(sample_lengths(64, 5), cluster, CM, tokens_per_rank=16384)]
    tok = static_plan(lens, cluster, 2, "zigzag_ring", balance="tokens")
    tok.validate(lens, cluster, CM)
    totals = sorted(sum(lens[i] for i in g.seqs) for g in tok.groups)
    assert totals[-1] - totals[0] <= max(lens)
    assert best_static_plan(lens, cluster, balance="tokens").solver == "static"
    # by hand, 2 ranks: by tokens 100K | 70K, the first 40K joins the 70K group (fewer tokens), the
    # second the 100K one (100K < 110K tokens); by time the 100K document's attention outweighs 150K
    # tokens of shorter ones, so both 40K documents join the 70K one
    lens = [100_000, 70_000, 40_000, 40_000]
    two = ClusterSpec.h100(2)
    by_tokens = static_plan(lens, two, 1, "zigzag_ring", balance="tokens")
    by_time = static_plan(lens, two, 1, "zigzag_ring")
    assert sorted(g.seqs for g in by_tokens.groups) == [(0, 3), (1, 2)]
    assert sorted(g.seqs for g in by_time.groups) == [(0,), (1, 2, 3)]
    assert by_time.estimated_time < by_tokens.estimated_time / 1.1
    for bad in ("token", None):
        with pytest.raises(ValueError, match="balance"):
            static_plan(lens, two, 1, "zigzag_ring", balance=bad)
        with pytest.raises(ValueError, match="balance"):
            best_static_plan(lens, two, balance=bad)


@pytest.mark.parametrize("lens, match", [
    ([], "empty"), ([100, 0], "positive"), ([100, -5], "positive"), ([10.5], "whole"), ("123", "seq_lens"),
    ([10 ** 9], "does not fit"),
])
def test_bad_lengths(lens, match):
    with pytest.raises(ValueError, match=match):
        plan_batch(lens, ClusterSpec.h100(8))


def test_bad_arguments():
    c = ClusterSpec.h100(8)
    with pytest.raises(ValueError, match="solver"):
        plan_batch([100], c, solver="scip")
    with pytest.raises(ValueError, match="methods"):
        plan_batch([100], c, methods=["flash"])
    with pytest.raises(ValueError, match="time_limit"):
        plan_batch([100], c, time_limit=0)
    with pytest.raises(ValueError, match="cluster"):
        plan_batch([100], 8)
    with pytest.raises(ValueError, match="fits memory"):  # each fits alone, the batch does not
        plan_batch([150_000] * 10, c)


def test_bucketize_is_exact_for_few_lengths_and_contiguous_otherwise():
    lens = np.array([5, 5, 9, 100, 9, 7], dtype=float)
    b = bucketize(lens, (1.0, 0.0), 16)
    assert len(b) == 4 and b.counts.sum() == 6 and np.allclose(b.longest, b.mean)
    lens = np.exp(np.random.default_rng(0).uniform(0, 12, 300)).round() + 1
    b = bucketize(lens, (1e-4, 2e-9), 16)
    assert len(b) == 16 and b.counts.sum() == 300
    order = np.argsort(lens)
    assert np.all(np.diff(b.bucket_of[order]) >= 0)  # buckets are contiguous ranges of lengths
    assert np.all(lens <= b.longest[b.bucket_of])


# ---------------------------------------------------------------------------------------- plan object
def test_plan_json_round_trip_and_executor_view():
    cluster = ClusterSpec.h100(16)
    lens = [200_000, 50_000] + [3_000] * 40
    plan = plan_batch(lens, cluster)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    again.validate(lens, cluster, CM)
    seen = []
    for r in range(16):
        (g,) = plan.groups_for_rank(r)
        assert r in g.ranks
        mine = local_batch(plan, r, lens)
        assert sorted(mine) == sorted(g.seqs)
        assert [lens[i] for i in mine] == sorted((lens[i] for i in mine), reverse=True)
        if r == g.start:
            seen += mine
    assert sorted(seen) == list(range(len(lens)))
    assert "groups on 16 ranks" in plan.summary(lens)
    with pytest.raises(ValueError, match="rank"):
        plan.groups_for_rank(16)
    with pytest.raises(ValueError, match="plan JSON"):
        Plan.from_json("{}")
    with pytest.raises(ValueError, match="sequence"):
        plan.validate(lens + [5], cluster)


def test_plan_ahead_returns_plans_in_order():
    cluster = ClusterSpec.h100(8)
    batches = [[40_000, 1_000, 2_000], [5_000] * 9, [120_000, 300]]
    with PlanAhead(cluster, solver="greedy") as ahead:
        ahead.submit(batches[0])
        for i in range(len(batches)):
            if i + 1 < len(batches):
                ahead.submit(batches[i + 1])
            plan = ahead.result(timeout=30)
            plan.validate(batches[i], cluster, CM)
        assert ahead.pending == 0
        with pytest.raises(ValueError, match="positive"):
            ahead.submit([0])
        with pytest.raises(ValueError, match="nothing submitted"):
            ahead.result()


# ---------------------------------------------------------------------------------------- CLI
def test_cli_plan(tmp_path, capsys):
    f = tmp_path / "lens.txt"
    f.write_text("# lengths\n120000\n3000\n3000\n800\n\n45000\n")
    png = tmp_path / "plan.png"
    out = tmp_path / "plan.json"
    assert plan_main([str(f), "--world-size", "16", "--plot", str(png), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speedup over best static" in text and png.stat().st_size > 1000
    Plan.from_json(out.read_text()).validate([120000, 3000, 3000, 800, 45000], ClusterSpec.h100(16), CM)
    (tmp_path / "l.json").write_text("[5000, 7000, 9000]")
    assert plan_main([str(tmp_path / "l.json"), "--solver", "greedy", "--methods", "ulysses,zigzag_ring"]) == 0
    assert plan_main(["--dist", "stdlib", "--num-seqs", "32", "--world-size", "8"]) == 0
    capsys.readouterr()
    # a named machine: its links and FLOP rates; explicit flags override it
    assert plan_main([str(f), "--world-size", "16", "--profile", "a100-nvlink-ib", "--inter-bw", "5"]) == 0
    text = capsys.readouterr().out
    assert "token-balancing packer" in text and "speedup over best static" in text
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    assert plan_main([str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert plan_main(["--dist", "stdlib", "--cost-model", str(bad)]) == 2


def test_default_checkpointing_trades_memory_for_recompute():
    """Layer checkpointing keeps ~410 KB/token for Llama-3-8B and recomputes the forward (attention
    3.5 -> 4.5 passes, weights 6P -> 8P FLOPs); without it every activation stays (~5.9 MB/token)."""
    layer, none = CostModel.default(), CostModel.default(checkpointing="none")
    a, b = layer.coeffs("zigzag_ring"), none.coeffs("zigzag_ring")
    assert a.alpha1 / b.alpha1 == pytest.approx(4.5 / 3.5) and a.alpha2 / b.alpha2 == pytest.approx(8 / 6)
    kv_buffer = 4 * 1024 * 2  # the ring's K,V double buffer, the same in both
    assert a.m_token - kv_buffer == pytest.approx(410e3, rel=0.03)
    assert b.m_token - kv_buffer == pytest.approx(5.9e6, rel=0.02)
    with pytest.raises(ValueError, match="checkpointing"):
        CostModel.default(checkpointing="full")


def test_bench_scheduler_baselines_cell():
    """The baselines benchmark's bookkeeping on a small cluster: the adaptive plan never loses to the
    per-batch static plan, and a configuration fixed for the whole run can never beat re-picking the
    best token-balanced configuration per batch."""
    import importlib
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    bench = importlib.import_module("bench_scheduler_baselines")
    rows = bench.cell("a100-nvlink-ib", 16, "fit", 8192, 2, 0.1, inter_gbps=5.0)
    assert {r["methods"] for r in rows} == {"all", "ring-only", "ulysses-only"}
    for r in rows:
        assert r["inter_gbps"] == 5.0 and r["batches"] == 2
        assert r["per_batch_median"] >= 1 - 1e-9 and r["per_batch_run"] >= 1 - 1e-9
        assert r["packer_run"] <= r["fixed_run"] * (1 + 1e-12)
        d, m = r["fixed_config"].split("x", 1)
        assert int(d) in (1, 2, 4, 8, 16) and m


# ------------------------------------------------------------------------ ranks sharing CPU cores
def _shared_cpu(slowdown4: float = 2.0):
    """4 ranks on 2 cores (the measured slowdown of 4 busy ranks: 2 = pure time sharing), one method
    whose compute is alpha2·s + alpha1·s² per rank and whose communication costs a fixed 10 ms."""
    cluster = ClusterSpec(world_size=4, ranks_per_node=4, cores=2, intra_node_bandwidth=1e9,
                          inter_node_bandwidth=1e9, memory_per_rank=1e12, latency_intra=1e-2,
                          latency_inter=1e-2, compute_slowdown_by_ranks=((1, 1.0), (2, 1.0), (4, slowdown4)))
    mc = MethodCost(alpha1=1e-8, alpha2=1e-5, beta1=0.0, m_token=1.0, m_model=0.0)
    cost = CostModel(methods=(("ulysses", mc),), hidden=64, kv_hidden=64, layers=1, n_heads=4)
    return cluster, cost


def test_shared_cores_plan_time_by_hand():
    """On shared cores a plan takes max(its slowest group alone, the time the cores need for every
    rank's compute shared fairly): the rank with one long document runs at full speed once the
    others are done, instead of at half speed all along."""
    cluster, cost = _shared_cpu()
    # no contention beyond time sharing (slowdown 2 = 4 ranks / 2 cores): 1 / 2 cores
    assert cluster.shares_cores and cluster.work_scale() == pytest.approx(0.5)
    w = lambda s: 1e-5 * s + 1e-8 * s * s  # noqa: E731  (one rank's compute alone)
    lens = [4000, 500, 500, 500]
    p = static_plan(lens, cluster, 1, "ulysses", cost)
    assert sorted(g.seqs for g in p.groups) == [(0,), (1,), (2,), (3,)]
    # processor sharing: 4 busy ranks at half speed until the three short ones are done (each has
    # w(500) of compute), then the long one alone at full speed; the model of every rank busy all
    # along said 2 x w(4000)
    assert p.estimated_time == pytest.approx(w(500) / 0.5 + (w(4000) - w(500)))
    assert cluster.shared_makespan([w(4000), w(500), w(500), w(500)]) == pytest.approx(p.estimated_time)
    assert cluster.shared_makespan([w(4000), 0, 0, 0]) == pytest.approx(w(4000))
    with pytest.raises(ValueError, match="rank_work"):
        cluster.shared_makespan([1.0, 2.0])
    two_nodes = ClusterSpec(world_size=8, ranks_per_node=4, cores=2)  # nodes do not share cores
    assert two_nodes.shared_makespan([1, 1, 1, 1, 3, 0, 0, 0]) == pytest.approx(3.0)
    assert two_nodes.shared_makespan([1, 1, 1, 1, 1, 0, 0, 0]) == pytest.approx(2.0)
    # balanced: the cores bind, as with the per-group model and all ranks busy
    even = [2000] * 8
    q = static_plan(even, cluster, 1, "ulysses", cost)
    assert q.estimated_time == pytest.approx(8 * w(2000) / 2)
    # contention beyond time sharing (slowdown 2.5 for 4 ranks on 2 cores) scales the work bound
    cl25, _ = _shared_cpu(2.5)
    assert static_plan(even, cl25, 1, "ulysses", cost).estimated_time == pytest.approx(1.25 * 8 * w(2000) / 2)
    # a group of 4 alone is slowed by all 4 of its ranks sharing the 2 cores, and communicates
    r = static_plan(even, cluster, 4, "ulysses", cost)
    assert r.estimated_time > 2 * sum(map(w, even)) / 4
    # a GPU cluster is unchanged: no core sharing, no work term
    gpu = ClusterSpec(world_size=4, ranks_per_node=4, memory_per_rank=1e12)
    assert not gpu.shares_cores and gpu.work_scale() == 0.0
    assert static_plan(lens, gpu, 1, "ulysses", cost).estimated_time == pytest.approx(w(4000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 6000), min_size=1, max_size=24))
def test_shared_cores_planner(lens):
    """On shared cores the plans stay valid, the estimate never drops below the certified bound or the
    work bound, the planner never loses to a static plan, and the unbounded MILP never to greedy."""
    cluster, cost = _shared_cpu(2.2)
    plan = plan_batch(lens, cluster, cost, time_limit=None)
    plan.validate(lens, cluster, cost)
    w = sum(1e-5 * s + 1e-8 * s * s for s in lens)
    assert plan.estimated_time >= cluster.work_scale() * w * (1 - 1e-9)
    assert plan.bound is None or plan.estimated_time >= plan.bound * (1 - 1e-9)
    assert plan.estimated_time <= best_static_plan(lens, cluster, cost).estimated_time * (1 + 1e-9)
    greedy = plan_batch(lens, cluster, cost, solver="greedy")
    assert plan.estimated_time <= greedy.estimated_time * (1 + 1e-9)


def test_shared_cores_memory_and_idle_groups():
    """Regressions: on shared cores a layout over memory is never returned (its time is infinite, as
    on GPUs), and the MILP stays feasible when a selected group runs nothing (β1 = 1 ms per group)."""
    from dataclasses import replace

    cm = CostModel.default()
    tight = ClusterSpec(world_size=8, ranks_per_node=8, cores=2, memory_per_rank=20e9)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(30):
        lens = [int(x) for x in rng.integers(1000, 40000, size=int(rng.integers(2, 9)))]
        try:
            plan_batch(lens, replace(tight, cores=0), cm)
        except ValueError:  # does not fit even with a device per rank
            continue
        plan = plan_batch(lens, tight, cm)  # validates the plan, memory included
        plan.validate(lens, tight, cm)
        assert math.isfinite(plan.estimated_time)
        checked += 1
    assert checked >= 10
    for lens in ([4096, 4096], [1000] * 3, [8000, 300, 200]):  # fewer sequences than ranks
        plan = plan_batch(lens, ClusterSpec(world_size=8, ranks_per_node=8, cores=2), cm, time_limit=None)
        assert "infeasible" not in plan.notes, plan.notes
