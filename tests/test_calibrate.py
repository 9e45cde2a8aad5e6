"""seqpar calibrate: the fits, the JSON file, the CPU core-sharing model, and a quick run on 2 ranks."""

import json

import numpy as np
import pytest

from seqpar.schedulers import ClusterSpec, CostModel, plan_batch
from seqpar.bench.calibrate import build_models, calibrate, fit_compute, fit_link, measure_group_scales, tailed_docs
from seqpar.schedulers.calibration import load_calibration, save_calibration
from seqpar.schedulers.cost import MethodCost


def test_fit_compute_recovers_known_coefficients():
    a1, a2, b = 3e-9, 2e-6, 4e-3
    lens = [256, 512, 1024, 2048, 4096]
    exact = [a1 * s * s + a2 * s + b for s in lens]
    got = fit_compute(lens, exact)
    assert got == pytest.approx((a1, a2, b), rel=1e-6)
    # 2% multiplicative noise: the fitted curve still predicts every point within a few percent
    rng = np.random.default_rng(0)
    noisy = [t * (1 + 0.02 * rng.standard_normal()) for t in exact]
    f1, f2, f3 = fit_compute(lens, noisy)
    assert min(f1, f2, f3) >= 0
    for s, t in zip(lens, exact):
        assert f1 * s * s + f2 * s + f3 == pytest.approx(t, rel=0.06)


def test_fit_compute_never_returns_negative_coefficients():
    # a pure s² curve with a dip at the short end would pull an unconstrained beta1 below zero
    lens, times = [100, 200, 400, 800], [5e-5, 1.5e-4, 6e-4, 2.4e-3]
    a1, a2, b = fit_compute(lens, times)
    assert a1 > 0 and a2 >= 0 and b >= 0
    with pytest.raises(ValueError, match="distinct"):
        fit_compute([512, 512], [1.0, 1.0])


def test_fit_link_recovers_bandwidth_and_latency():
    bw, lat = 2.5e9, 40e-6
    sizes = [1 << 14, 1 << 18, 1 << 22]
    got_bw, got_lat = fit_link(sizes, [lat + m / bw for m in sizes])
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)


def _synthetic_measurements(world=4, slow=(1.0, 1.05, 2.1)):
    lens = [512, 1024, 2048]
    a1, a2, b = 2e-8, 1e-6, 1e-3
    links = {g: {kind: [(m, 1e-4 + m / bw) for m in (1 << 16, 1 << 20)]
                 for kind, bw in (("p2p", 1e9), ("all_to_all", 5e8), ("all_gather", 8e8))} for g in (2, 4)}
    return {"shape": {"heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 1}, "seq_lens": lens, "world_size": world,
            "compute": {"zigzag_ring": [a1 * s * s + a2 * s + b for s in lens]},
            "core sharing": {1: slow[0], 2: slow[1], 4: slow[2]}, "links": links,
            "overlap": {"overlap": 0.5},
            "memory": {"bytes_per_token": 1000.0, "rss": 3e8, "memory_per_rank": 8e9, "element_size": 4,
                       "device": "cpu"}}


def test_build_models_from_measurements():
    cluster, cost = build_models(_synthetic_measurements(), ["zigzag_ring", "ulysses", "ring"])
    assert cluster.world_size == 4 and cluster.ranks_per_node == 4 and cluster.overlap_factor == 0.5
    assert cluster.bandwidth(2) == pytest.approx(1e9) and cluster.bandwidth(4, "all_to_all") == pytest.approx(5e8)
    assert cluster.latency(4, "all_gather") == pytest.approx(1e-4)
    assert cluster.compute_slowdown(4) == pytest.approx(2.1) and cluster.compute_slowdown(1) == 1.0
    z = cost.coeffs("zigzag_ring")
    assert (z.alpha1, z.alpha2, z.beta1) == pytest.approx((2e-8, 1e-6, 1e-3), rel=1e-6)
    assert cost.coeffs("ulysses").alpha1 == z.alpha1  # one timed kernel shared by the others
    assert (cost.hidden, cost.kv_hidden, cost.n_heads, cost.bytes_per_element) == (64, 32, 4, 4)
    # core sharing enters the model: 4 ranks on this machine compute 2.1x slower than one alone
    s = 4096
    g = cost.group_coeffs("zigzag_ring", 4, cluster)
    assert g.quad == pytest.approx(2.1 * z.alpha1 / 4)
    t4 = cost.time("zigzag_ring", 4, [s], cluster)
    assert t4 > 2.1 * z.alpha1 * s * s / 4


def test_group_scale_multiplies_the_two_parts_not_memory_and_round_trips(tmp_path):
    cluster, cost = build_models(_synthetic_measurements(), ["zigzag_ring", "ulysses"])
    scaled = cost.with_group_scales({"zigzag_ring": {2: (1.5, 3.0), 4: (0.5, 2.0)}})
    lens = [3000, 700, 64]
    s1, s2 = sum(lens), sum(s * s for s in lens)
    for d, (ka, kr) in ((1, (1.5, 3.0)), (2, (1.5, 3.0)), (4, (0.5, 2.0))):  # no entry for 1: the nearest above
        a, r = cost.group_coeffs("zigzag_ring", d, cluster).parts(s1, s2)
        assert a > 0 and r > 0
        assert scaled.time("zigzag_ring", d, lens, cluster) == pytest.approx(ka * a + kr * r)
        assert scaled.memory("zigzag_ring", d, lens) == cost.memory("zigzag_ring", d, lens)
    assert scaled.time("ulysses", 4, lens, cluster) == cost.time("ulysses", 4, lens, cluster)
    assert scaled.coeffs("zigzag_ring").scale(8) == (0.5, 2.0)  # beyond the table: the largest size below
    path = tmp_path / "scaled.json"
    scaled.save(path)
    assert CostModel.load(path) == scaled and scaled.without_group_scales() == cost
    for bad in ([(3, 1.0, 1.0)], [(2, 0.0, 1.0)], [(2, 1.0, float("nan"))], [(2, 1.0)], [("2", 1.0, 1.0)]):
        with pytest.raises(ValueError, match="group_scale"):
            MethodCost(alpha1=1.0, alpha2=1.0, beta1=0.0, m_token=1.0, m_model=1.0, group_scale=bad)


def test_kernel_scale_from_emulated_efficiency(tmp_path):
    """An emulated efficiency e at size d (its schedule's imbalance i) gives the factor 1 / (e·i) on
    the attention term only; it survives the JSON file and is dropped for other hardware."""
    from seqpar.schedulers.replay_table import causal_imbalance

    meas = _synthetic_measurements()
    meas["kernels"] = {"zigzag_ring": {2: 0.8, 4: 0.5}, "ring": {4: 0.5}}
    cluster, cost = build_models(meas, ["zigzag_ring", "ring"])
    _, plain = build_models(_synthetic_measurements(), ["zigzag_ring", "ring"])
    assert cost.coeffs("zigzag_ring").kernel_scale == ((2, 1.25), (4, 2.0))
    assert cost.coeffs("ring").kernel(4) == pytest.approx(1 / (0.5 * causal_imbalance("ring", 4)))
    assert cost.coeffs("ring").kernel(1) == 1.0  # one rank runs the single-rank kernel the fit measured
    g, g0 = cost.group_coeffs("zigzag_ring", 4, cluster), plain.group_coeffs("zigzag_ring", 4, cluster)
    assert g.quad == pytest.approx(2.0 * g0.quad) and (g.lin, g.const, g.overlap) == (g0.lin, g0.const, g0.overlap)
    path = tmp_path / "k.json"
    cost.save(path)
    assert CostModel.load(path) == cost and cost.for_other_hardware() == plain
    with pytest.raises(ValueError, match="kernel_scale"):
        MethodCost(alpha1=1.0, alpha2=1.0, beta1=0.0, m_token=1.0, m_model=1.0, kernel_scale=[(2, -1.0)])


def test_fit_group_scale_separates_attention_from_the_rest():
    from seqpar.bench.calibrate import fit_group_scale

    rows = [{"attn_s": a, "rest_s": r, "measured_s": 2.0 * a + 0.5 * r} for a, r in ((1.0, 4.0), (4.0, 8.0), (16, 16))]
    assert fit_group_scale(rows) == pytest.approx((2.0, 0.5))
    # one row, or rows that cannot tell the parts apart: one common factor (the median ratio)
    assert fit_group_scale(rows[:1]) == pytest.approx((0.8, 0.8))  # (2·1 + 0.5·4) / (1 + 4)
    assert fit_group_scale(rows[:2]) == pytest.approx((0.9, 0.9))  # two rows: one factor, the median ratio
    same = [{"attn_s": s, "rest_s": s, "measured_s": 3.0 * s} for s in (1.0, 2.0, 4.0)]
    k = fit_group_scale(same)
    assert k[0] * 1 + k[1] * 1 == pytest.approx(3.0) and min(k) > 0


def test_measure_group_scales_is_measured_over_modelled():
    """With a stand-in for the ranks that 'measures' 3x (g=1) and 0.5x (g=2, 4) of each plan's
    estimate, both factors are exactly those; g = 1 runs one plan and counts for every method."""
    from seqpar.schedulers.plan import Plan

    cluster, cost = build_models(_synthetic_measurements(), ["zigzag_ring", "ulysses"])
    calls = []

    def fake_run(fn, plans_json, lens, shape, seed, warmup, repeats):
        plans = [Plan.from_json(t) for t in plans_json]
        calls.append((len(plans), {g.size for p in plans for g in p.groups}))
        return [([p.estimated_time * (3.0 if p.groups[0].size == 1 else 0.5)] * repeats, 0.0) for p in plans]

    batches = [(g, tailed_docs(g * c) * (4 // g)) for c in (1000, 3000) for g in (1, 2, 4)]
    assert tailed_docs(1000) == [500, 250, 125, 125] and sum(batches[1][1]) == 4000
    scales, rows = measure_group_scales(fake_run, cluster, cost, ["zigzag_ring", "ulysses"], batches, (4, 2, 16), 2)
    assert set(scales) == {"zigzag_ring", "ulysses"}
    for m in scales:
        assert set(scales[m]) == {1, 2, 4}
        for g, k in scales[m].items():
            assert k == pytest.approx((3.0, 3.0) if g == 1 else (0.5, 0.5)), (m, g)
    assert calls == [(1, {1}), (2, {2}), (2, {4})] * 2 and len(rows) == 10
    assert all(r["ratio"] == pytest.approx(3.0 if r["group_size"] == 1 else 0.5) for r in rows)


def test_compute_slowdown_model():
    c = ClusterSpec(world_size=8, cores=2, compute_slowdown_by_ranks=((1, 1.0), (2, 1.1)))
    assert c.compute_slowdown(1) == 1.0 and c.compute_slowdown(2) == pytest.approx(1.1)
    assert c.compute_slowdown() == pytest.approx(4.4)  # beyond the measurements: shares 2 cores further
    assert ClusterSpec(world_size=8, cores=2).compute_slowdown() == 4.0  # unmeasured: N / cores
    assert ClusterSpec.h100(64).compute_slowdown() == 1.0  # a device per rank
    with pytest.raises(ValueError, match="cores"):
        ClusterSpec(world_size=8, cores=-1)
    with pytest.raises(ValueError, match="overlap_factor"):
        ClusterSpec(world_size=8, overlap_factor=1.5)


def test_calibration_file_round_trip_and_bad_files(tmp_path):
    cluster, cost = build_models(_synthetic_measurements(), ["zigzag_ring", "ulysses"])
    path = tmp_path / "cal.json"
    save_calibration(path, cluster, cost, measurements={"note": "synthetic"}, command="test")
    assert load_calibration(path) == (cluster, cost)
    assert CostModel.load(path) == cost  # a calibration file is also a cost-model file
    with pytest.raises(ValueError, match="method 'ring' is missing"):
        CostModel.load(path, required=["ring"])
    data = json.loads(path.read_text())

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        CostModel.load(bad)
    neg = json.loads(json.dumps(data))
    neg["cost_model"]["methods"]["ulysses"]["alpha1"] = -1e-9
    bad.write_text(json.dumps(neg))
    with pytest.raises(ValueError, match="'ulysses'.*alpha1"):
        load_calibration(bad)
    with pytest.raises(ValueError, match="'ulysses'.*alpha1"):
        CostModel.load(bad)
    no_cluster = {k: v for k, v in data.items() if k != "cluster"}
    bad.write_text(json.dumps(no_cluster))
    with pytest.raises(ValueError, match="'cluster'"):
        load_calibration(bad)
    wrong = json.loads(json.dumps(data))
    wrong["cluster"]["measured_links"][0][2] = -5
    bad.write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match="measured_links"):
        load_calibration(bad)
    with pytest.raises(ValueError, match="cannot be read"):
        load_calibration(tmp_path / "missing.json")


def test_calibrate_bad_arguments_fail_before_spawning():
    with pytest.raises(ValueError, match="nproc"):
        calibrate(nproc=3, quick=True, progress=False)
    with pytest.raises(ValueError, match="methods"):
        calibrate(nproc=2, methods=["zeco"], quick=True, progress=False)
    with pytest.raises(ValueError, match="seq_lens"):
        calibrate(nproc=2, seq_lens=[512], quick=True, progress=False)


def test_calibrate_quick_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "cal.json"
    cluster, cost = calibrate(nproc=2, methods=["zigzag_ring", "ulysses", "ring"], heads=2, head_dim=16,
                              seq_lens=[128, 256, 512], quick=True, out=out, progress=False, command="test")
    assert (cluster, cost) == load_calibration(out)
    assert CostModel.load(out, required=["zigzag_ring", "ulysses"]) == cost
    data = json.loads(out.read_text())
    assert data["format"] == "seqpar-calibration" and data["command"] == "test" and data["versions"]["torch"]
    assert cluster.world_size == 2 and cluster.cores >= 1
    assert {k for k, _ in cluster.compute_slowdown_by_ranks} == {1, 2}
    assert {(g, kind) for g, kind, *_ in cluster.measured_links} == {(2, "p2p"), (2, "all_to_all"), (2, "all_gather")}
    for _, c in cost.methods:
        assert c.alpha1 + c.alpha2 > 0 and c.m_token > 0
        # the last phase timed real packed steps on groups of 1 and 2: a positive factor for each
        assert [e[0] for e in c.group_scale] == [1, 2] and all(min(e[1:]) > 0 for e in c.group_scale)
        assert [d for d, _ in c.kernel_scale] == [2] and c.kernel_scale[0][1] > 0  # emulated on 2 "ranks"
    assert {(r["method"], r["group_size"]) for r in data["measurements"]["groups"]} == \
        {("zigzag_ring", 1), ("zigzag_ring", 2), ("ulysses", 2), ("ring", 2)}
    # the scheduler can plan with it (on this 2-rank CPU machine)
    plan = plan_batch([900, 300, 200, 100], cluster, cost, time_limit=1.0)
    assert sorted(i for g in plan.groups for i in g.seqs) == [0, 1, 2, 3]
    assert plan.estimated_time > 0
