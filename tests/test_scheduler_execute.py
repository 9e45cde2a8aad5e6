"""Executing a scheduler plan (seqpar.schedulers.execute) on CPU gloo, N=4.

A tiny model (embedding, one attention layer with q/k/v/o projections calling seqpar.attention,
a linear head) trained one step under several plans must give the loss and every parameter
gradient of the same batch on one rank, each sequence its own causal document.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.schedulers import ClusterSpec, GroupCache, GroupPlan, Plan, plan_batch, rank_work, train_step
from seqpar.schedulers.execute import execute_plan
from seqpar.testing import run_distributed

WORLD = 4
LENS = [3, 40, 7, 90, 1, 25]
VOCAB, DIM, HEADS = 32, 16, 4
IGNORE = -100


class TinyModel(torch.nn.Module):
    """Embedding -> one attention layer (residual) -> linear head. ``attn(q, k, v)`` is injected."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.q = torch.nn.Linear(DIM, DIM)
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)
        self.o = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids, attn):  # ids [1, T] -> logits [1, T, VOCAB]
        x = self.emb(ids)
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, HEADS, DIM // HEADS) for proj in (self.q, self.k, self.v))
        x = x + self.o(attn(q, k, v).reshape(b, t, DIM))
        return self.head(x)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    labels = [torch.cat([s[1:], torch.tensor([IGNORE])]) for s in ids]  # next token; the last is ignored
    return ids, labels


def _model_state():
    torch.manual_seed(1)
    return TinyModel().state_dict()


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def _reference():
    """One rank, no seqpar: each sequence alone, causal; loss = sum over tokens / token count."""
    model = TinyModel()
    model.load_state_dict(_model_state())
    ids, labels = _batch()
    total = sum(int((lab != IGNORE).sum()) for lab in labels)
    loss = sum(F.cross_entropy(model(i[None], _sdpa)[0], lab, ignore_index=IGNORE, reduction="sum")
               for i, lab in zip(ids, labels)) / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _run_plans(state, plans_json):
    """On every rank: one GroupCache, then one train_step per plan; returns (loss, grads) per plan."""
    rank = dist.get_rank()
    groups = GroupCache()
    ids, labels = _batch()
    out = []
    for text in plans_json:
        plan = Plan.from_json(text)
        model = TinyModel()
        model.load_state_dict(state)

        def loss_fn(work):
            ids_local = work.shard(work.pack(ids))                        # [1, T_local], padding 0
            lab_local = work.shard(work.pack(labels), pad_value=IGNORE)  # padding rows ignored
            logits = model(ids_local, work.attention)
            ce = F.cross_entropy(logits[0], lab_local[0], ignore_index=IGNORE, reduction="sum")
            return ce, int((lab_local != IGNORE).sum())

        loss = train_step(plan, LENS, rank, groups, loss_fn, model.parameters())
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _plans():
    cluster = ClusterSpec(world_size=WORLD, ranks_per_node=WORLD)
    planned = plan_batch(LENS, cluster, methods=["zigzag_ring", "ulysses", "ring", "striped_ring"], time_limit=1.0)
    planned.validate(LENS, cluster)
    g = GroupPlan
    plans = {
        "planned": planned,
        # groups of different sizes: 2 + 1 + 1
        "2+1+1": Plan(WORLD, (g(0, 2, "zigzag_ring", (3, 1)), g(2, 1, "zigzag_ring", (5, 0)),
                              g(3, 1, "ring", (2, 4))), 0.0, solver="manual"),
        # one group of 4, Ulysses (head scatter) over every sequence
        "4 ulysses": Plan(WORLD, (g(0, 4, "ulysses", tuple(range(len(LENS)))),), 0.0, solver="manual"),
        # two groups of 2 with different methods; the lone 1-token sequence on its own group
        "2+2 mixed": Plan(WORLD, (g(0, 2, "ulysses", (3, 1, 2)), g(2, 2, "striped_ring", (4, 5, 0))), 0.0,
                          solver="manual"),
        # ranks 2 and 3 idle: they contribute zero gradients but still join the all-reduce
        "2+idle": Plan(WORLD, (g(0, 2, "allgather_kv", tuple(range(len(LENS)))), g(2, 1, "ring", ()),
                               g(3, 1, "ring", ())), 0.0, solver="manual"),
    }
    for p in plans.values():
        p.validate(LENS, cluster)
    return plans


def test_executed_plans_match_single_rank():
    start = time.perf_counter()
    ref_loss, ref_grads = _reference()
    plans = _plans()
    results = run_distributed(_run_plans, WORLD, _model_state(), [p.to_json() for p in plans.values()], timeout=120)
    for k, name in enumerate(plans):
        for rank in range(WORLD):
            loss, grads = results[rank][k]
            # fp32 throughout; the distributed run merges softmax blocks online across ranks and sums
            # gradients in another order (dK/dV around the ring, the all-reduce over ranks), so it
            # matches the reference up to fp32 rounding of those reorderings, not bitwise.
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, rank)
            for pname, ref in ref_grads.items():
                torch.testing.assert_close(grads[pname], ref, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"plan {name!r}, rank {rank}, {pname}: {m}")
    assert time.perf_counter() - start < 60


def _work_summary(state):
    rank = dist.get_rank()
    groups = GroupCache()
    plan = Plan(WORLD, (GroupPlan(0, 2, "zigzag_ring", (0, 1, 2)), GroupPlan(2, 2, "ring", (3, 4, 5))), 0.0)
    work = rank_work(plan, LENS, rank, groups)
    ids, _ = _batch()
    # execute_plan hands the packed stream to the caller; unshard restores the group's global order
    packed = execute_plan(plan, LENS, rank, groups, lambda w: w.unshard(w.shard(w.pack(ids))))
    errors = []
    for bad in (dict(sizes=[3]), dict(sizes=[8])):
        try:
            GroupCache(**bad)
        except ValueError as exc:
            errors.append(str(exc))
    wrong_world = Plan(2, (GroupPlan(0, 2, "ring", tuple(range(6))),), 0.0)
    try:
        rank_work(wrong_world, LENS, rank, groups)
    except ValueError as exc:
        errors.append(str(exc))
    return (len(groups), work.seqs, work.cu_seqlens.tolist(), work.group_rank, dist.get_world_size(work.group),
            packed, errors)


def test_group_cache_and_rank_work():
    out = run_distributed(_work_summary, WORLD, None, timeout=60)
    ids, _ = _batch()
    for rank, (n_groups, seqs, cu, group_rank, gsize, packed, errors) in enumerate(out):
        assert n_groups == 3  # a member of one group of each size 1, 2, 4
        assert seqs == ((1, 2, 0) if rank < 2 else (3, 5, 4))  # longest first
        assert cu == ([0, 40, 47, 50] if rank < 2 else [0, 90, 115, 116])
        assert group_rank == rank % 2 and gsize == 2
        torch.testing.assert_close(packed, torch.cat([ids[i] for i in seqs])[None], rtol=0, atol=0)
        assert len(errors) == 3 and "sizes" in errors[0] and "sizes" in errors[1] and "world_size" in errors[2]


def test_group_cache_needs_distributed():
    with pytest.raises(ValueError, match="not initialised"):
        GroupCache()


# ----------------------------------------------------------------------------- bench_scheduler_exec's logic
BENCH_DIR = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks")


def _bench_module():
    import importlib
    import sys

    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module("bench_scheduler_exec")


def _bench_child(*args):
    from seqpar.bench.measure import phase_plans

    return phase_plans(*args)


def test_bench_scheduler_exec_tiny():
    """The measured benchmark at toy sizes: every static (degree, method) and the adaptive plan run,
    each executed step gives the float64 single-rank loss of the same batch (so every plan really
    computed the whole batch's attention), and the speedup is the best measured static over adaptive."""
    from seqpar.schedulers import CostModel, MethodCost
    from seqpar.bench.measure import _plan_inputs

    bench = _bench_module()
    start = time.perf_counter()
    lens, heads, head_dim, seed = [37, 5, 12, 3, 21, 8], 4, 8, 3
    cluster = ClusterSpec(world_size=WORLD, ranks_per_node=WORLD, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
                          memory_per_rank=1e9, latency_intra=1e-4, latency_inter=1e-4)
    mc = MethodCost(alpha1=1e-8, alpha2=1e-6, beta1=1e-3, m_token=1e3, m_model=1e6)
    cost = CostModel(methods=(("zigzag_ring", mc), ("ulysses", mc)), hidden=heads * head_dim,
                     kv_hidden=heads * head_dim, layers=1, n_heads=heads, bytes_per_element=4)
    rows = bench.run_batch(lens, cluster, cost, ["zigzag_ring", "ulysses"], nproc=WORLD, heads=heads,
                           head_dim=head_dim, seed=seed, warmup=0, repeats=1, time_limit=0.5,
                           run=lambda fn, args: run_distributed(_bench_child, WORLD, *args, timeout=120)[0])
    labels = [r["plan"] for r in rows]
    assert labels == ["adaptive", "static 1xany", "static 2xzigzag_ring", "static 2xulysses",
                      "static 4xzigzag_ring", "static 4xulysses"]
    ref = 0.0  # float64, one rank: sum over sequences of <causal attention(q, k, v), dout>, / tokens
    for i, n in enumerate(lens):
        q, k, v, dout = (t.double() for t in _plan_inputs(i, n, (heads, heads, head_dim), seed))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True).transpose(0, 1)
        ref += float((out * dout).sum())
    ref /= sum(lens)
    for r in rows:
        # fp32 attention merged across ranks vs float64 on one rank: ~1e-6 relative on these sizes
        assert r["loss"] == pytest.approx(ref, rel=1e-4, abs=1e-6), r["plan"]
        assert r["measured_s"] > 0 and r["predicted_s"] > 0
    best = min((r for r in rows if r["kind"] == "static"), key=lambda r: r["measured_s"])
    assert rows[0]["best_static"] == best["plan"]
    assert rows[0]["speedup_measured"] == pytest.approx(best["measured_s"] / rows[0]["measured_s"])
    assert time.perf_counter() - start < 20
