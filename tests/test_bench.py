"""``seqpar bench``: suite parsing and validation, the matrix, FLOP formulas, a real 2-rank run with
CSV/JSON/PNG output, failing rows, and the single-device emulation of N ranks."""

import csv
import json
import os

import pytest

from seqpar.bench import BenchCase, attention_flops, expand_matrix, linear_flops, load_suite, run_cases
from seqpar.bench.emulate import emulate_cases, rank_calls
from seqpar.bench.suite import validate_case

SUITES = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "suites")


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch):
    """The tests spawn their own ranks: no torchrun variables, one node (usp's default degree)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _suite(tmp_path, data, name="s.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_example_suites_parse_and_expand():
    counts = {}
    for name in sorted(os.listdir(SUITES)):
        if name.endswith((".json", ".yaml")):
            counts[name] = len(expand_matrix(load_suite(os.path.join(SUITES, name))))
    # cpu_quick: 8 softmax methods x MHA/GQA + 3 linear (causal MHA only) = 19
    assert counts["cpu_quick.json"] == 19 and counts["cpu_full.json"] == 140 and counts["gpu.json"] == 70


def test_matrix_counts_and_linear_rows():
    cases = expand_matrix({"methods": "all", "seq_lens": ["1k", 2048], "world_sizes": [2, 4], "causal": "both",
                           "heads": 8, "kv_heads": [8, 2]})
    # softmax: 8 methods x 2 T x 2 N x 2 causal x 2 kv; linear: 3 x 2 T x 2 N, causal MHA only
    assert len(cases) == 8 * 2 * 2 * 2 * 2 + 3 * 2 * 2
    lin = [c for c in cases if c.family == "linear"]
    assert all(c.causal and c.kv_heads == c.heads for c in lin)
    assert {c.seq_len for c in cases} == {1024, 2048}


def test_unknown_key_and_method_in_suite(tmp_path):
    with pytest.raises(ValueError, match="unknown key.*method_list"):
        load_suite(_suite(tmp_path, {"method_list": ["ring"]}))
    with pytest.raises(ValueError, match="methods: unknown method 'zigzag'"):
        expand_matrix(load_suite(_suite(tmp_path, {"methods": ["ring", "zigzag"]})))
    with pytest.raises(ValueError, match="dtypes: 'fp8'"):
        expand_matrix({"methods": "ring", "dtypes": ["fp8"]})


def test_yaml_suite(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "s.yaml"
    path.write_text("methods: [ring, zeco]\nseq_lens: [1k]\nworld_sizes: [2]\ncausal: both\n")
    cases = expand_matrix(load_suite(str(path)))
    assert [(c.method, c.causal) for c in cases] == [("ring", True), ("zeco", True), ("ring", False)]


@pytest.mark.parametrize("config, match", [
    ({"methods": "ring", "heads": 8, "kv_heads": 3}, "kv_heads: .*heads=8 is not divisible by kv_heads=3"),
    ({"methods": "zigzag_ring", "seq_lens": [100], "world_sizes": [4]}, "seq_lens: .*multiple of 8 \\(2N\\)"),
    ({"methods": "ulysses", "heads": 3, "kv_heads": 1, "world_sizes": [4]}, "heads: .*heads=3 is fewer than N=4"),
    ({"methods": "usp", "seq_lens": [1026], "world_sizes": [4]}, "seq_lens: .*usp .*multiple of R\\*lcm"),
    ({"methods": "zeco", "seq_lens": [1001], "world_sizes": [2]}, "seq_lens: .*zeco.*multiple of N=2"),
    ({"methods": "zeco", "causal": False}, "causal: zeco are causal linear attention"),
], ids=["gqa", "zigzag-length", "ulysses-heads", "usp-length", "linear-length", "linear-noncausal"])
def test_impossible_shapes_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        expand_matrix(config)


def test_too_few_ranks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match="world_sizes: .*16 local ranks on 1 CPU cores"):
        expand_matrix({"methods": "ring", "seq_lens": [1024], "world_sizes": [16]})
    assert len(expand_matrix({"methods": "ring", "seq_lens": [1024], "emulate": 16})) == 1  # emulated: fine
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="world_sizes: .*asks for 4 ranks but torchrun launched WORLD_SIZE=2"):
        validate_case(BenchCase("ring", 1024, 4))


def test_cli_rejects_bad_suite_before_running(tmp_path, capsys):
    from seqpar.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--suite", _suite(tmp_path, {"methods": ["ring", "nope"]}), "--no-progress"])
    assert exc.value.code == 2 and "methods: unknown method 'nope'" in capsys.readouterr().err


def test_flop_formulas_by_hand():
    # B=1, T=4, Hq=2, D=3: QK^T and PV are 4x4x3 per head, 2 FLOPs per multiply-add: 2 * 2 * 48 * 2 = 384
    assert attention_flops(1, 4, 2, 3, causal=False) == (384.0, 960.0)
    assert attention_flops(1, 4, 2, 3, causal=True) == (192.0, 480.0)
    # B=1, T=2, H=1, K=2, V=3, C=4: per token 2*4*(2+3) + 4*2*3 = 64, two tokens = 128; backward 2x
    assert linear_flops(1, 2, 1, 2, 3, chunk=4) == (128.0, 256.0)


def test_two_rank_run_writes_csv_json_png(tmp_path):
    from seqpar.cli import main

    js, cs, plots = tmp_path / "rows.json", tmp_path / "rows.csv", tmp_path / "plots"
    rc = main(["bench", "--methods", "zigzag_ring,zeco", "--seq-lens", "128", "-n", "2", "--heads", "4",
               "--head-dim", "16", "--repeats", "1", "--warmup", "0", "--no-progress", "--json", str(js),
               "--csv", str(cs), "--plots", str(plots)])
    data = json.loads(js.read_text())
    rows = data["rows"]
    assert rc == 0 and [r["method"] for r in rows] == ["zigzag_ring", "zeco"]
    assert {"machine", "torch", "seqpar", "command"} <= set(data["environment"])
    for r in rows:
        assert r["error"] == "" and r["max_error"] < 1e-5 and r["efficiency"] > 0 and r["tflops"] > 0
        assert r["bytes_fwd"] > 0 and r["busiest_link"] > 0
        # the output of one rank (64 tokens x 4 heads x 16 fp32) is allocated inside the measured call
        assert r["peak_mem"] >= 64 * 4 * 16 * 4
        assert r["tokens_per_s"] == pytest.approx(128 / (r["step_ms"] * 1e-3))
    with open(cs) as f:
        lines = list(csv.DictReader(f))
    assert [x["method"] for x in lines] == ["zigzag_ring", "zeco"] and all(x["env.torch"] for x in lines)
    for name in ("efficiency_vs_length.png", "bytes_per_rank_vs_n.png", "memory_per_rank_vs_n.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"


def test_failing_row_does_not_abort_the_others(capsys):
    from seqpar.bench import print_table

    # 66 tokens cannot be split into zigzag chunks on 2 ranks: the row fails at run time (not validated
    # here on purpose) and the next row still runs
    # (and ulysses with 3 query heads on 2 ranks runs 2 + 1 heads and reports max/mean heads 4/3)
    cases = [BenchCase("zigzag_ring", 66, 2, heads=2, kv_heads=2, head_dim=8, repeats=1, warmup=0),
             BenchCase("ring", 64, 2, heads=2, kv_heads=2, head_dim=8, repeats=1, warmup=0),
             BenchCase("ulysses", 64, 2, heads=3, kv_heads=1, head_dim=8, repeats=1, warmup=0)]
    rows = run_cases(cases, progress=False)
    assert "ValueError" in rows[0]["error"] and "multiple of 4" in rows[0]["error"]
    assert rows[1]["error"] == "" and rows[1]["max_error"] < 1e-5
    assert rows[2]["error"] == "" and rows[2]["max_error"] < 1e-5
    assert [r["head_imbalance"] for r in rows] == [1.0, 1.0, pytest.approx(4 / 3)]
    emu = emulate_cases([BenchCase("zigzag_ring", 66, 2, repeats=1, warmup=0),
                         BenchCase("ring", 64, 2, heads=2, kv_heads=2, head_dim=8, repeats=1, warmup=0)],
                        progress=False)
    assert "even local length" in emu[0]["error"] and emu[1]["error"] == ""
    print_table(rows + emu)
    out = capsys.readouterr().out
    assert "multiple of 4" in out and "x1.333" in out  # Hq/Hkv "3/1 x1.333"


def test_emulated_schedules_match_the_methods():
    n, T = 4, 1024
    # zigzag causal: every rank computes the same number of pairs, one block per compute step
    for method in ("zigzag_ring", "token_ring"):
        pairs = [sum(c.pairs() for s in rank_calls(method, r, n, T, True, 2, 2) for c in s) for r in range(n)]
        assert len(set(pairs)) == 1 and sum(pairs) == T * (T + 1) // 2 * 2
    ring = [[len(s) for s in rank_calls("ring", r, n, T, True, 2, 2)] for r in range(n)]
    assert [sum(x) for x in ring] == [1, 2, 3, 4]  # contiguous causal: rank r computes r+1 blocks
    # lightseq, even N: the busiest rank computes the diagonal and N/2 full blocks -> bound ~ N/(N+1)
    from seqpar.bench.emulate import _ratios

    work = [[float(sum(c.pairs() for c in s)) for s in rank_calls("lightseq", r, n, T, True, 1, 1)] for r in range(n)]
    bound, _, _ = _ratios(work, n, T * (T + 1) / 2)
    assert bound == pytest.approx(n / (n + 1), rel=0.01)
    # ulysses GQA 8/2 on 4 ranks: one block per rank with 2 query heads and 1 K,V head
    calls = rank_calls("ulysses", 1, n, T, True, 8, 2)
    assert [(c.q_heads, c.kv_heads, c.t_local) for c in calls[0]] == [(2, 1, T)]


def test_emulate_measures_imbalance(tmp_path):
    from seqpar.bench.plots import write_plots

    # 3 repeats: each (rank, step) time is the minimum over them, so one descheduled tiny kernel on
    # the shared CI cores does not fake an imbalance
    cases = [BenchCase(m, 512, 4, True, heads=4, kv_heads=4, head_dim=16, repeats=3, warmup=1)
             for m in ("ring", "zigzag_ring", "ulysses", "zeco")]
    rows = {r["method"]: r for r in emulate_cases(cases, progress=False)}
    assert all(r["error"] == "" and r["mode"] == "emulate" for r in rows.values())
    # ring causal: at step 3 only rank 3 works, so that step's max/mean is about
    # 4; zigzag: every rank computes half a block per step (~1, timing noise aside)
    assert rows["ring"]["imbalance"] > 3.5 > 3 > rows["zigzag_ring"]["imbalance"]
    assert rows["ring"]["bound"] < 0.6 and rows["zigzag_ring"]["bound"] == pytest.approx(1.0, abs=1e-3)
    assert rows["ring"]["extra"]["rank_calls"] == [1, 2, 3, 4]
    for r in rows.values():
        assert 0 < r["efficiency"] and r["single_ms"] > 0 and len(r["extra"]["rank_ms"]) == 4
    (path,) = write_plots(list(rows.values()), str(tmp_path))
    assert path.endswith("emulate_efficiency.png") and open(path, "rb").read(4) == b"\x89PNG"


@pytest.mark.parametrize("cores, threads, expected", [(1, 1, 2), (2, 1, 2), (3, 1, 3), (64, 1, 8), (8, 2, 4)])
def test_default_ranks_are_what_the_cores_run_side_by_side(monkeypatch, cores, threads, expected):
    """Without --nproc, one rank per usable core (per --threads cores), at least 2, at most 8: a newcomer's
    first table is not 4 ranks crowded onto 2 cores."""
    import seqpar.comm.launch as launch
    from seqpar.bench.cli import build_parser, config_from_args

    monkeypatch.setattr(launch, "usable_cores", lambda: cores)
    parser = build_parser()
    config = config_from_args(parser.parse_args(["--threads", str(threads)]), parser)
    assert config["world_sizes"] == [expected]
    explicit = config_from_args(parser.parse_args(["--nproc", "3,5"]), parser)
    assert explicit["world_sizes"] == ["3", "5"]  # an explicit list is kept as given (validated later)


def test_the_table_says_when_ranks_share_cores(monkeypatch):
    import seqpar.comm.launch as launch
    from seqpar.bench.cli import core_sharing_note

    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    rows = [{"world_size": 2}, {"world_size": 4}, {"world_size": 8}]
    note = core_sharing_note(rows, threads=1)
    assert "4, 8 ranks x 1 thread(s) share 2 usable core(s)" in note and "low by up to 4x" in note
    assert "--nproc 2" in note
    assert core_sharing_note([{"world_size": 2}], threads=1) is None  # a core per rank: nothing to say


def test_the_table_says_when_other_processes_kept_the_cores_busy():
    from seqpar.bench.cli import busy_machine_note

    note = busy_machine_note(25.3, 2)  # measured here: a shared 2-core machine, efficiencies 0.28-0.62 at 2 ranks
    assert "load average 25.3 on 2 usable core(s)" in note and "efficiency column" in note
    assert busy_machine_note(0.4, 2) is None and busy_machine_note(None, 2) is None  # idle, or no load average


def test_a_first_bench_run_prints_no_library_warnings(tmp_path):
    """What a new user sees from `seqpar bench` (default ranks, the peak-memory profile on): the table and
    nothing of torch's profiler ("Memory block of unknown size ...", profiler start/stop lines)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    res = subprocess.run([sys.executable, "-m", "seqpar", "bench", "--methods", "ring,ulysses", "--seq-lens", "256",
                          "--heads", "2", "--head-dim", "8", "--repeats", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ulysses" in res.stdout and "efficiency" in res.stdout
    noise = [line for line in res.stderr.splitlines() if line.strip()]
    assert not noise, "library output on stderr:\n" + "\n".join(noise[:10])


def test_peak_memory_keeps_the_profilers_note_off_stderr():
    """The CPU peak is a torch.profiler run; freeing a block allocated before it started makes torch's
    allocator print "Memory block of unknown size ..." (every bench row frees its inputs' buffers). A
    fresh process, since torch prints it once per process."""
    import subprocess
    import sys

    code = ("import torch\nfrom seqpar.bench.memory import PeakMemory\nx = torch.empty(1 << 20)\n"
            "with PeakMemory('cpu') as m:\n    del x\n    y = torch.ones(1 << 18)\nprint(m.peak)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.split()[-1]) == (1 << 18) * 4  # y, allocated inside: the peak counts it
    assert "Memory block of unknown size" not in res.stderr and not res.stderr.strip(), res.stderr
