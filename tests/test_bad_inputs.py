"""Bad input on every public entry point: a clear ValueError naming the argument, on EVERY rank,
before any communication (so nothing hangs), within 10 s.

Multi-rank cases run on the shared gloo pools (world 2, or 4 for meshes); each rank catches its own
exception and returns ``(type name, message, seconds)``, and the test asserts that every rank
raised ``ValueError`` matching the expected words. A case that hangs a rank fails by the 10 s
timeout of its call. Cases marked ``check_ranks`` depend on the rank (one rank passes something
else); they are caught by the cross-rank agreement check (:mod:`seqpar.comm.agreement`), without
which they would hang or fail obscurely.

New cases here (entry point: case -- expected words):

==  =========================  ==========================================  ========================
 #  entry point                case                                        world / how
==  =========================  ==========================================  ========================
 1  seqpar.attention           k on another device (meta) than q           2 ranks
 2  seqpar.attention           head dims differ (q D=16, k/v D=8)          2 ranks
 3  seqpar.attention           Hq=6 not a multiple of Hkv=4                2 ranks
 4  seqpar.attention           a linear method ("zeco") as method          2 ranks
 5  seqpar.attention           unknown backend                             2 ranks
 6  seqpar.attention           group of the wrong type (a str)             2 ranks
 7  seqpar.attention           a 2-D DeviceMesh for a 1-D method           4 ranks
 8  seqpar.attention (usp)     ulysses_degree=3 does not divide 4 ranks    4 ranks
 9  seqpar.attention           zigzag with odd T_local                     2 ranks
10  seqpar.attention           empty local sequence (T_local = 0)          2 ranks
11  seqpar.attention           float cu_seqlens holding NaN                2 ranks
12  seqpar.attention           cu_seqlens list holding inf                 2 ranks
13  seqpar.attention           cu_seqlens list holding 3.5 (non-integer)   2 ranks
14  seqpar.attention           2-D cu_seqlens                              2 ranks
15  seqpar.attention           q of another T_local on rank 1              2 ranks, check_ranks
16  seqpar.attention           another method on rank 1                    2 ranks, SEQPAR_CHECK_RANKS=1
17  seqpar.attention           heads not divisible on rank 1 only          2 ranks, check_ranks
18  seqpar.attention           causal differs on rank 1                    2 ranks, check_ranks
19  seqpar.attention           packed, cu_seqlens differs on rank 1        2 ranks, check_ranks
20  seqpar.attention (usp)     2x2 mesh, causal differs on rank 3 only     4 ranks, check_ranks
20b seqpar.attention (usp)     the same, default settings                  4 ranks
20c seqpar.attention (usp)     (ulysses, ring) pair, T_local differs       4 ranks
21  seqpar.shard               dim out of range (was silently wrapped)     2 ranks
22  seqpar.shard               T=7 not a multiple of N=2 (striped)         2 ranks
23  seqpar.unshard             x_local of another shape on rank 1          2 ranks, check_ranks
24  seqpar.linear_attention    k shape differs from q                      2 ranks
25  seqpar.linear_attention    unknown method                              2 ranks
26  seqpar.linear_attention    cu_seqlens not ending at N * T_local        2 ranks
27  seqpar.linear_attention    NaN log-decay g (was accepted silently)     2 ranks
28  seqpar.linear_attention    cu_seqlens differs on rank 1 (was silent)   2 ranks (always checked)
29  seqpar.linear_attention    positive g on rank 1 only                   2 ranks, check_ranks
30  seqpar.linear_attention    initial_state of the wrong shape            2 ranks
31  seqpar.linear_attention    v in another dtype                          2 ranks
32  integrations.hf            shard_inputs: float cu_seqlens with NaN     2 ranks
33  integrations.hf            shard_inputs: float input_ids               2 ranks
34  schedulers.plan_batch      a fractional length                         local (no ranks)
35  schedulers.plan_batch      a non-positive length                       local
36  schedulers.static_plan     sp_degree 3 does not tile 4 ranks           local
37  schedulers.CostModel.load  a file that does not exist                  local
38  trainer config             --lr 0                                      local
39  trainer config             --save-every without --save                 local
==  =========================  ==========================================  ========================

Known gap (xfail, reported): ``plan_batch`` with a NaN length raises Python's bare "cannot convert
float NaN to integer", which does not name ``seq_lens`` (seqpar/schedulers is another owner's).

Existing tests that also count (all ValueError): tests/test_api.py ``test_bad_input_single_device``
(12 cases) and ``test_bad_input_raises_on_every_rank`` (4 cases on 2 ranks: length, heads, method,
dtype); tests/test_packed_attention.py ``test_bad_cu_seqlens_raise_on_every_rank`` (6 cu_seqlens
kinds incl. rank-dependent, 2 ranks); tests/test_linear.py
``test_bad_input_raises_on_every_rank_before_communicating`` (positive g, 2 ranks);
tests/test_hf.py ``test_bad_arguments`` (7) and ``test_length_not_fitting_the_layout_says_how_to_pad``
(2 ranks); tests/test_scheduler.py ``test_bad_lengths``, ``test_bad_arguments``, ``test_static_plan``,
``test_cost_model_json_round_trip_and_errors``; tests/test_trainer.py (seq-len, context-parallel,
empty data, different model, partial checkpoint).
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

import seqpar
from seqpar.schedulers import ClusterSpec, CostModel, plan_batch, static_plan
from seqpar.testing import get_pool, run_distributed

CASE_TIMEOUT = 10.0  # seconds: "every bad input raises on every rank within 10 s"


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _t(T=8, H=4, D=16, dtype=torch.float32):
    return torch.randn(1, T, H, D, dtype=dtype)


def _mesh_2d():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    # building the mesh's subgroups is collective: let every rank finish it before one raises and the
    # harness destroys the groups this case created (a rank still connecting would see them vanish)
    dist.barrier()
    return mesh


def _with_env(fn):
    saved = os.environ.get("SEQPAR_CHECK_RANKS")
    os.environ["SEQPAR_CHECK_RANKS"] = "1"
    try:
        return fn()
    finally:
        if saved is None:
            os.environ.pop("SEQPAR_CHECK_RANKS")
        else:
            os.environ["SEQPAR_CHECK_RANKS"] = saved


def _usp_mesh_causal_differs():
    """usp on a 2x2 mesh, only rank 3 differs: rank 0's row and column groups agree among themselves,
    so the check must carry the first axis's verdict along the second (it used to let rank 0 go on)."""
    mesh = _mesh_2d()
    q = _t(T=8)
    return seqpar.attention(q, q, q, method="usp", group=mesh, causal=_rank() != 3, check_ranks=True)


def _usp_pair_length_differs():
    """usp on a (ulysses_group, ring_group) pair, default settings: rank 3 passes 2 more tokens."""
    import torch.distributed as dist

    rows = [dist.new_group(r) for r in ([0, 1], [2, 3])]  # every rank creates every group, in order
    cols = [dist.new_group(c) for c in ([0, 2], [1, 3])]
    dist.barrier()
    q = _t(T=8 + 2 * (_rank() == 3))
    return seqpar.attention(q, q, q, method="usp", group=(rows[_rank() // 2], cols[_rank() % 2]))


def _packed_differs():
    cu = torch.tensor([0, 5, 12] if _rank() == 0 else [0, 6, 12], dtype=torch.int32)
    local = seqpar.shard(torch.zeros(1, 12, 2, 8), cu_seqlens=cu)
    return seqpar.attention(local, local, local, cu_seqlens=cu, check_ranks=True)


def _g_positive_on_rank_1():
    g = -torch.rand(1, 8, 4, 16)
    if _rank() == 1:
        g[0, 3, 1, 2] = 0.5
    return seqpar.linear_attention(_t(), _t(), _t(), g, check_ranks=True)


# name -> (world size, callable run on every rank, regex every rank's message must match)
CASES = {
    "attn_device": (2, lambda: seqpar.attention(_t(), _t().to("meta"), _t()), "device"),
    "attn_head_dim": (2, lambda: seqpar.attention(_t(), _t(D=8), _t(D=8)), "head dim"),
    "attn_heads_not_divisible": (2, lambda: seqpar.attention(_t(H=6), _t(H=4), _t(H=4)), "Hq"),
    "attn_linear_method": (2, lambda: seqpar.attention(_t(), _t(), _t(), method="zeco"), "method='zeco'"),
    "attn_backend": (2, lambda: seqpar.attention(_t(), _t(), _t(), backend="warp"), "backend='warp'"),
    "attn_group_type": (2, lambda: seqpar.attention(_t(), _t(), _t(), group="world"), "group: expected"),
    "attn_mesh_2d": (4, lambda: seqpar.attention(_t(), _t(), _t(), group=_mesh_2d(), method="ring"), "2-D DeviceMesh"),
    "usp_degree": (4, lambda: seqpar.attention(_t(), _t(), _t(), method="usp", ulysses_degree=3),
                   "ulysses_degree=3 does not divide"),
    "attn_zigzag_odd": (2, lambda: seqpar.attention(_t(T=7), _t(T=7), _t(T=7)), "odd"),
    "attn_empty": (2, lambda: seqpar.attention(_t(T=0), _t(T=0), _t(T=0), method="ring"), "empty"),
    "cu_nan": (2, lambda: seqpar.attention(_t(), _t(), _t(), cu_seqlens=torch.tensor([0.0, float("nan"), 16.0])),
               "cu_seqlens has dtype torch.float32"),
    "cu_inf": (2, lambda: seqpar.attention(_t(), _t(), _t(), cu_seqlens=[0, float("inf"), 16]), "cu_seqlens holds inf"),
    "cu_fraction": (2, lambda: seqpar.attention(_t(), _t(), _t(), cu_seqlens=[0, 3.5, 16]), "cu_seqlens holds 3.5"),
    "cu_2d": (2, lambda: seqpar.attention(_t(), _t(), _t(), cu_seqlens=torch.tensor([[0, 16]], dtype=torch.int32)),
              "cu_seqlens has shape"),
    "check_ranks_shape": (2, lambda: seqpar.attention(_t(T=8 + 8 * _rank()), _t(T=8 + 8 * _rank()),
                                                      _t(T=8 + 8 * _rank()), check_ranks=True),
                          r"rank 1 passed q of shape \(1, 16, 4, 16\) but rank 0 passed \(1, 8, 4, 16\)"),
    "check_ranks_env_method": (2, lambda: _with_env(lambda: seqpar.attention(
        _t(), _t(), _t(), method=["ring", "striped_ring"][_rank()])),
        "rank 1 passed method 'striped_ring' but rank 0 passed 'ring'"),
    "check_ranks_local_error": (2, lambda: seqpar.attention(_t(H=4 + 2 * _rank()), _t(H=4), _t(H=4), check_ranks=True),
                                r"Hq|rank\(s\) \[1\] rejected"),
    "check_ranks_causal": (2, lambda: seqpar.attention(_t(), _t(), _t(), causal=bool(_rank()), check_ranks=True),
                           "rank 1 passed causal True but rank 0 passed False"),
    "check_ranks_cu_seqlens": (2, _packed_differs, "rank 1 passed cu_seqlens"),
    "check_ranks_usp_mesh": (4, _usp_mesh_causal_differs, "rank 3 passed causal False but rank [12] passed True"),
    "usp_mesh_default": (4, lambda: seqpar.attention(_t(), _t(), _t(), method="usp", group=_mesh_2d(),
                                                     causal=_rank() != 3),
                         "rank 3 passed causal False but rank [12] passed True"),
    "usp_pair_default": (4, _usp_pair_length_differs, r"rank 3 passed q of shape \(1, 10, 4, 16\) but rank 2 passed"),
    "shard_dim": (2, lambda: seqpar.shard(_t(), dim=5), "dim=5 is not a dimension"),
    "shard_length": (2, lambda: seqpar.shard(_t(T=7), method="striped_ring"), "multiple of 2"),
    "unshard_check_ranks": (2, lambda: seqpar.unshard(_t(T=4 + 2 * _rank()), method="ring", check_ranks=True),
                            r"rank 1 passed x_local of shape \(1, 6, 4, 16\)"),
    "lin_k_shape": (2, lambda: seqpar.linear_attention(_t(), _t(D=8), _t()), "k: shape"),
    "lin_method": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(), method="zecoo"), "method='zecoo'"),
    "lin_cu_seqlens": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(), cu_seqlens=[0, 4, 9]),
                       r"cu_seqlens\[-1\] must equal N \* T_local = 2 \* 8 = 16"),
    "lin_cu_seqlens_differ": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(), cu_seqlens=[0, 5 + _rank(), 16]),
                              "rank 1 passed cu_seqlens 2 documents, 16 tokens"),
    "lin_g_nan": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(), torch.full((1, 8, 4, 16), float("nan"))),
                  "g: the log-decay .* NaN"),
    "lin_g_positive_one_rank": (2, _g_positive_on_rank_1, r"g: the log-decay|rank\(s\) \[1\] rejected"),
    "lin_initial_state": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(), initial_state=torch.zeros(1, 4, 16, 8)),
                          "initial_state: expected shape"),
    "lin_dtype": (2, lambda: seqpar.linear_attention(_t(), _t(), _t(dtype=torch.bfloat16)), "one dtype"),
    "hf_cu_nan": (2, lambda: _hf().shard_inputs(torch.zeros(1, 8, dtype=torch.long),
                                                cu_seqlens=torch.tensor([0.0, float("nan"), 8.0])), "cu_seqlens"),
    "hf_float_ids": (2, lambda: _hf().shard_inputs(torch.zeros(1, 8)), "input_ids: expected an integer tensor"),
}


def _hf():
    from seqpar.integrations import hf

    return hf


def _import_case_modules(name):
    """Import what a case's entry point needs (transformers for ``hf_*``) outside its 10 s: importing
    transformers alone took 6-25 s on the shared 2-core machine, which once failed hf_cu_nan by timeout."""
    if name.startswith("hf_"):
        _hf()


def _run_case(name):
    """On every rank: the case's exception as (type name, message, seconds), never raised."""
    start = time.monotonic()
    try:
        CASES[name][1]()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_on_every_rank(name):
    world, _, match = CASES[name]
    get_pool(world).start()  # spawning is not part of the 10 s
    run_distributed(_import_case_modules, world, name, timeout=300)  # nor importing (no communication)
    results = run_distributed(_run_case, world, name, timeout=CASE_TIMEOUT)
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert re.search(match, message), f"rank {rank}: {message!r} does not match {match!r}"
        assert seconds < CASE_TIMEOUT


def test_check_ranks_argument_wins_over_the_environment(monkeypatch):
    """check_ranks=False with SEQPAR_CHECK_RANKS=1: no gather (a single device needs none anyway),
    and a malformed variable is itself a clear error, read at call time."""
    from seqpar.comm.agreement import check_ranks_enabled

    monkeypatch.setenv("SEQPAR_CHECK_RANKS", "1")
    assert check_ranks_enabled(None) and not check_ranks_enabled(False)
    monkeypatch.setenv("SEQPAR_CHECK_RANKS", "0")
    assert not check_ranks_enabled(None) and check_ranks_enabled(True)
    monkeypatch.setenv("SEQPAR_CHECK_RANKS", "maybe")
    with pytest.raises(ValueError, match="SEQPAR_CHECK_RANKS='maybe'"):
        seqpar.attention(_t(), _t(), _t())
    with pytest.raises(ValueError, match="check_ranks: expected"):
        seqpar.attention(_t(), _t(), _t(), check_ranks="yes")


def _agreeing_ranks():
    """Agreeing ranks pass the check and get the same result as without it."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=gen) for _ in range(3))
    local = [seqpar.shard(t, method="zigzag_ring", check_ranks=True) for t in (q, k, v)]
    checked = seqpar.attention(*local, causal=True, check_ranks=True)
    plain = seqpar.attention(*local, causal=True, check_ranks=False)
    back = seqpar.unshard(checked, check_ranks=True)
    o, _ = seqpar.linear_attention(q[:, :8], k[:, :8], v[:, :8], -torch.rand(1, 8, 4), check_ranks=True)
    return bool(torch.equal(checked, plain)), tuple(back.shape), tuple(o.shape)


def test_check_ranks_passes_when_ranks_agree():
    for same, shape, lin in run_distributed(_agreeing_ranks, 2, timeout=60):
        assert same and shape == (1, 16, 4, 8) and lin == (1, 8, 4, 8)


# ---------------------------------------------------------------- local entry points (no ranks)


def _cluster():
    return ClusterSpec.h100(world_size=4)


def _train_cfg(tmp_path, *extra):
    from seqpar.integrations.train.config import parse_args

    (tmp_path / "a.txt").write_text("hello world " * 200)
    return parse_args(["--data", str(tmp_path), "--seq-len", "16", "--nproc", "2", *extra])


LOCAL = {
    "plan_fraction": (lambda tmp: plan_batch([100, 3.5], _cluster()), "seq_lens: lengths must be whole numbers"),
    "plan_nonpositive": (lambda tmp: plan_batch([100, -3], _cluster()), "seq_lens: lengths must be positive"),
    "static_plan_degree": (lambda tmp: static_plan([100, 200], _cluster(), 3, "ring"), "sp_degree"),
    "cost_model_missing": (lambda tmp: CostModel.load(str(tmp / "missing.json")), "missing.json"),
    "trainer_lr": (lambda tmp: _validate(_train_cfg(tmp, "--lr", "0")), "--lr"),
    "trainer_save_every": (lambda tmp: _validate(_train_cfg(tmp, "--save-every", "2")), "--save-every"),
}


def _validate(cfg):
    from seqpar.integrations.train.config import validate

    return validate(cfg, 2)


@pytest.mark.parametrize("name", list(LOCAL))
def test_bad_input_local_entry_points(name, tmp_path):
    fn, match = LOCAL[name]
    with pytest.raises(ValueError, match=match):
        fn(tmp_path)


def test_plan_batch_nan_length_names_the_argument():
    with pytest.raises(ValueError, match="seq_lens"):
        plan_batch([100, float("nan")], _cluster())
