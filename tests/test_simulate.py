"""seqpar simulate: consistency of the projections, profiles, outputs, errors, and the byte model
against what the methods really send on 2 gloo ranks."""

import json
from dataclasses import replace

import pytest

from seqpar.schedulers.cluster import PROFILES, ClusterSpec, get_profile
from seqpar.schedulers.cost import SOFTMAX_METHODS, CostModel
from seqpar.bench.simulate import DEFAULT_WORLD_SIZES, plot_efficiency, simulate, simulate_main

H100 = get_profile("h100-nvlink-ib")
CM = CostModel.default()  # Llama-3-8B shape, H100 FLOP rates


def _rows(seq_len=131072, cluster=None, cost=CM, sizes=(1, 2, 4, 8, 16, 64, 256, 1024), methods=SOFTMAX_METHODS):
    rows = simulate(seq_len, cluster or H100.cluster(8), cost, world_sizes=sizes, methods=methods)
    return {(r["method"], r["world_size"]): r for r in rows}


def test_one_rank_is_the_ideal_and_rows_are_consistent():
    rows = _rows()
    for m in SOFTMAX_METHODS:
        assert rows[m, 1]["efficiency"] == pytest.approx(1.0) and rows[m, 1]["bytes_per_rank"] == 0
    for r in rows.values():
        if r["error"]:
            assert r["method"] == "ulysses" and r["world_size"] > 32  # 32 query heads
            continue
        assert 0 < r["efficiency"] <= 1 + 1e-9
        assert r["step_ms"] == pytest.approx(r["compute_ms"] + r["exposed_comm_ms"])
        assert r["exposed_comm_ms"] >= -1e-9 and r["exposed_comm_ms"] <= r["comm_ms"] + 1e-9
        assert r["comm_bound"] == (r["comm_ms"] >= r["compute_ms"])


def test_ring_efficiency_falls_once_communication_exceeds_compute():
    slow = replace(H100.cluster(8), intra_node_bandwidth=2e9, inter_node_bandwidth=1e9)
    fast, starved = _rows(cluster=H100.cluster(8)), _rows(cluster=slow)
    for n in (16, 64, 256):
        z_fast, z_slow = fast["zigzag_ring", n], starved["zigzag_ring", n]
        assert z_slow["comm_bound"] and z_slow["efficiency"] < z_fast["efficiency"]
    # zigzag at T=128K on H100s: hidden under compute up to a few hundred GPUs, then comm-bound
    assert fast["zigzag_ring", 16]["efficiency"] > 0.95 and not fast["zigzag_ring", 16]["comm_bound"]
    effs = [fast["zigzag_ring", n]["efficiency"] for n in (1, 2, 4, 8, 16, 64, 256, 1024)]
    assert effs == sorted(effs, reverse=True) and fast["zigzag_ring", 1024]["comm_bound"]
    # contiguous ring: attention alone (no linear work) is capped by the causal imbalance d / (2d - 1)
    attn_only = replace(CM, methods=tuple((n, replace(c, alpha2=0.0, beta1=0.0)) for n, c in CM.methods))
    ring = _rows(cost=attn_only, sizes=(1, 8), methods=["ring", "zigzag_ring"])
    assert ring["ring", 8]["efficiency"] == pytest.approx(8 / 15, rel=1e-3)
    assert ring["zigzag_ring", 8]["efficiency"] > 0.99


def test_more_bandwidth_never_slows_a_method():
    base = H100.cluster(8)
    doubled = replace(base, intra_node_bandwidth=2 * base.intra_node_bandwidth,
                      inter_node_bandwidth=2 * base.inter_node_bandwidth)
    for seq_len in (8192, 131072, 1 << 20):
        a, b = _rows(seq_len, base), _rows(seq_len, doubled)
        for key, r in a.items():
            if not r["error"]:
                assert b[key]["step_ms"] <= r["step_ms"] * (1 + 1e-12), key


def test_profiles_exist_and_bad_names_are_clear_errors():
    assert {"h100-nvlink-ib", "h200-nvlink-ib", "a100-nvlink-ib", "pcie"} <= set(PROFILES)
    for p in PROFILES.values():
        c = p.cluster(64)
        assert c.bandwidth(8) >= c.bandwidth(16) > 0 and c.num_nodes == 8
    assert get_profile("a100-nvlink-ib").intra_node_bandwidth < H100.intra_node_bandwidth
    with pytest.raises(ValueError, match="h100-nvlink-ib"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="not in this cost model"):
        simulate(4096, H100.cluster(8), CM, methods=["warp_ring"])
    with pytest.raises(ValueError, match="world_sizes"):
        simulate(4096, H100.cluster(8), CM, world_sizes=[12])
    assert simulate_main(["--profile", "tpu"]) == 2
    assert simulate_main(["--methods", "warp_ring"]) == 2


def test_cli_writes_csv_json_and_plot(tmp_path, capsys):
    png, csv_path, js = tmp_path / "eff.png", tmp_path / "rows.csv", tmp_path / "rows.json"
    assert simulate_main(["--seq-len", "256k", "--profile", "a100-nvlink-ib", "--plot", str(png), "--csv",
                          str(csv_path), "--json", str(js)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    rows = json.loads(js.read_text())["rows"]
    assert {r["world_size"] for r in rows} == set(DEFAULT_WORLD_SIZES)
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1
    assert "N=1024" in capsys.readouterr().out
    plot_efficiency(rows, str(tmp_path / "again.png"), "t")


def test_ring_bytes_match_the_implementation_formula():
    # docs/methods.md: K,V (N-1) hops fwd and bwd in the input dtype + N hops of fp32 dK,dV
    cost = CostModel.default(hidden=256, kv_hidden=128, layers=1, n_heads=8)
    cost = replace(cost, bytes_per_element=4, grad_bytes_per_element=4)
    c = ClusterSpec(world_size=8)
    for n in (2, 4, 8):
        T = 1024 * n
        kv = 2 * (T // n) * 128
        want = (n - 1) * kv * 4 * 2 + n * kv * 4
        assert cost.comm_bytes("zigzag_ring", n, T, c.with_world_size(n)) == pytest.approx(want)


def test_validate_on_two_ranks_bytes_exact_and_rows_complete():
    """A tiny --validate run: every method's modelled bytes equal what its busiest rank sent."""
    from seqpar.bench.sim_validate import summary, validate

    from seqpar.bench.calibrate import build_models
    from test_calibrate import _synthetic_measurements

    meas = _synthetic_measurements(world=2)
    meas["shape"] = {"heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 1}
    cal = build_models(meas, list(SOFTMAX_METHODS))
    methods = ["zigzag_ring", "allgather_kv", "token_ring", "ulysses"]
    rows = validate(world_sizes=[2], seq_len=64, heads=4, kv_heads=2, head_dim=16, methods=methods,
                    calibration=cal, repeats=1, warmup=0, progress=False, group_scales=True)
    assert [r["method"] for r in rows] == methods and not any(r["error"] for r in rows)
    for r in rows:
        assert r["measured_bytes"] == pytest.approx(r["predicted_bytes"]), r["method"]
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        # the prediction is the formula corrected by what the method measured at T/8, T/4, T/2 on 2 ranks
        ka, kr = r["group_scale"]
        assert min(ka, kr) > 0 and min(ka, kr) * r["formula_ms"] <= r["predicted_ms"] * (1 + 1e-9)
        assert r["predicted_ms"] <= max(ka, kr) * r["formula_ms"] * (1 + 1e-9)
        # the speed probe rescales the formula by the machine's speed during this very case
        assert r["probe_ratio"] > 0 and r["probe_ms"] == pytest.approx(r["formula_ms"] * r["probe_ratio"])
    s = summary(rows)
    assert s["rows"] == len(methods) and s["max_abs_error"] >= s["median_abs_error"]


def test_parse_lengths():
    """One parser for every command's token counts: k = 1024, m = 1024², errors name the option."""
    from seqpar.schedulers.data import parse_length, parse_lengths

    assert parse_lengths("2k, 1m,5") == [2048, 1048576, 5]
    assert parse_length(" 8K ") == 8192 and parse_length(4096) == 4096
    for bad in ("8x", "k", "", "1.5k"):
        with pytest.raises(ValueError, match="--seq-len"):
            parse_length(bad, "--seq-len")
