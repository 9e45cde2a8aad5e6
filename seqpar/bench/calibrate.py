"""``seqpar calibrate``: measure the cost model's coefficients on this machine (seqpar/schedulers/README.md).

API (stable; the scheduler codes against it)::

    from seqpar.bench.calibrate import calibrate
    from seqpar.schedulers.calibration import load_calibration

    cluster, cost = calibrate(nproc=4, methods=None, seq_lens=None, heads=8, kv_heads=None,
                              head_dim=32, layers=1, quick=False, repeats=None, out=None,
                              progress=True)              # -> (ClusterSpec, CostModel)
    cluster, cost = load_calibration("calib.json")      # -> (ClusterSpec, CostModel)
    plan = plan_batch(seq_lens, cluster.with_world_size(4), cost)

``calibrate`` spawns ``nproc`` local CPU ranks (gloo, one thread each,
:class:`seqpar.comm.pool.LocalRanks`); under ``torchrun`` it uses the launched ranks instead (every rank calls it;
CUDA devices when available, ``nproc`` ignored) and only rank 0 writes ``out``. It measures, in
phases (one progress-bar step each):

* compute: each method's single-rank causal attention forward+backward at a few lengths ``s``,
  least-squares fit (non-negative) of ``t(s) = alpha1·s² + alpha2·s + beta1`` (:func:`fit_compute`);
* core sharing: the same kernel on k = 1, 2, 4, ... ranks at once over its time alone
  (``ClusterSpec.compute_slowdown_by_ranks``; N single-thread ranks on C < N cores each compute
  about N/C times slower — measured, not assumed);
* links: per aligned group size g, every block of g ranks at once, a ring exchange, an
  all-to-all and an all-gather of a few message sizes, fit ``t = latency + bytes / bandwidth``
  (:func:`fit_link`, ``ClusterSpec.measured_links``);
* overlap: a ring exchange issued before the compute kernel and waited for after it, against the
  two alone: ``overlap = (t_compute + t_comm - t_both) / min(t_compute, t_comm)`` in [0, 1];
* memory: bytes saved for backward per token (saved-tensor hooks) plus q, k, v, out;
* kernels: each method's per-rank kernels on groups of 2, 4, ... emulated on one device at the
  largest length (:func:`.measure.phase_kernels`); 1 / (efficiency x the schedule's imbalance) is
  how much more than its share of the work the method's kernels take (``MethodCost.kernel_scale``;
  e.g. striped_ring's strided blocks run as dense masked blocks on the CPU path);
* groups (``groups=True``): the model above composes single-rank compute, core sharing and links,
  which misses what only a real group shows (one big Ulysses kernel over fewer heads, LightSeq's
  helper traffic, gloo progress under load). So every method then runs real packed training steps
  on every group size g at once (:func:`measure_group_scales`: the world tiled by groups of g, each
  packing long-tailed documents of ``group_tokens`` tokens per rank) and a fit of the measured
  times to the model's attention part and the rest gives ``MethodCost.group_scale`` for (method, g)
  (:func:`fit_group_scale`). g = 1 runs once (every method runs the same local kernel alone).

The coefficients are per attention layer times ``layers`` (the CostModel's ``layers`` scales the
communication the same way). The JSON file (:func:`seqpar.schedulers.calibration.save_calibration`) is
``{"format": "seqpar-calibration", "version": 1, "cluster": {...}, "cost_model": {...},
"measurements": {...}, "machine": {...}, "versions": {...}, "command": "..."}``; ``CostModel.load``
reads its ``cost_model`` part and :func:`~seqpar.schedulers.calibration.load_calibration` both parts.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from seqpar.comm.collectives import peer_errors
from seqpar.comm.launch import (
    launched_by_torchrun,
    launched_process_group,
    progress_track,
    usable_cores,
)
from seqpar.comm.pool import LocalRanks
from seqpar.methods import METHODS
from seqpar.schedulers.calibration import save_calibration
from seqpar.schedulers.cluster import ClusterSpec, is_power_of_two
from seqpar.schedulers.cost import SOFTMAX_METHODS, CostModel, MethodCost

from .measure import (
    phase_compute,
    phase_kernels,
    phase_links,
    phase_memory,
    phase_overlap,
    phase_plans,
    phase_slowdown,
)

DEFAULT_SEQ_LENS = (1024, 2048, 4096)
QUICK_SEQ_LENS = (256, 512, 1024)
DEFAULT_MESSAGE_BYTES = (1 << 16, 1 << 19, 1 << 22)  # 64 KiB, 512 KiB, 4 MiB
QUICK_MESSAGE_BYTES = (1 << 14, 1 << 18)


# ----------------------------------------------------------------------------- fits
def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 for a handful of columns: best over the subsets of active columns."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((a[:, cols] @ x - y) ** 2))
                if res < best_res:
                    best, best_res = np.zeros(n), res
                    best[list(cols)] = x
    return best


def fit_compute(seq_lens: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Fit ``t(s) = alpha1·s² + alpha2·s + beta1`` (all >= 0) to timings; returns (alpha1, alpha2, beta1).

    Rows are weighted by 1/t, so the fit minimises relative error (timings span orders of magnitude).
    Needs at least two distinct lengths.
    """
    s, t = np.asarray(seq_lens, float), np.asarray(seconds, float)
    if s.shape != t.shape or len(set(s.tolist())) < 2 or np.any(s <= 0) or np.any(t <= 0):
        raise ValueError(f"fit_compute: need >= 2 distinct positive lengths with positive times, got "
                         f"seq_lens={list(s)}, seconds={list(t)}")
    a = np.stack([s * s, s, np.ones_like(s)], axis=1) / t[:, None]
    a1, a2, b = _nonneg_lstsq(a, np.ones_like(t))
    return float(a1), float(a2), float(b)


def fit_link(message_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = latency + bytes / bandwidth`` (both >= 0); returns (bandwidth bytes/s, latency s)."""
    m, t = np.asarray(message_bytes, float), np.asarray(seconds, float)
    if m.shape != t.shape or len(set(m.tolist())) < 2 or np.any(t <= 0):
        raise ValueError(f"fit_link: need >= 2 distinct message sizes with positive times, got "
                         f"bytes={list(m)}, seconds={list(t)}")
    inv_bw, lat = _nonneg_lstsq(np.stack([m, np.ones_like(m)], axis=1) / t[:, None], np.ones_like(t))
    if inv_bw <= 0:  # time did not grow with size: bandwidth beyond what the sizes resolve
        inv_bw = float(np.max(t) / np.max(m)) * 1e-3
    return float(1.0 / inv_bw), float(lat)


# ----------------------------------------------------------------------------- driver
def _runner(nproc: int, ranks: LocalRanks):
    """(run(fn, *args) -> rank 0's result, world size, is rank 0): local ranks or launched ranks."""
    if launched_by_torchrun():  # torchrun: every rank runs every phase (the group is the caller's)
        import torch.distributed as dist

        def run(fn, *args):  # rank 0's result, on every rank (the next phases and the models need it)
            box = [fn(*args)]
            with peer_errors(name="calibration broadcast"):
                dist.broadcast_object_list(box, src=0)
            return box[0]
        return run, dist.get_world_size(), dist.get_rank() == 0
    return (lambda fn, *args: ranks.run(fn, nproc, *args, timeout=3600)[0]), nproc, True


def _check_args(nproc, methods, seq_lens, heads, kv_heads, head_dim, layers) -> None:
    for name, value in (("nproc", nproc), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not is_power_of_two(nproc):
        raise ValueError(f"nproc={nproc}: sequence-parallel groups are powers of two; use 1, 2, 4, 8, ...")
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    bad = [m for m in methods if m not in METHODS or m not in SOFTMAX_METHODS]
    if bad or not methods:
        raise ValueError(f"methods: unknown or not calibratable {bad or methods}; choose from "
                         f"{', '.join(m for m in METHODS if m in SOFTMAX_METHODS)}")
    if len(set(seq_lens)) < 2 or any(not isinstance(s, int) or s < 16 for s in seq_lens):
        raise ValueError(f"seq_lens: need at least two distinct lengths >= 16 for the fit, got {list(seq_lens)}")


def calibrate(*, nproc: int | None = None, methods: Sequence[str] | None = None,
              seq_lens: Sequence[int] | None = None, heads: int = 8, kv_heads: int | None = None,
              head_dim: int = 32, layers: int = 1, quick: bool = False, repeats: int | None = None,
              out: str | Path | None = None, progress: bool = True, share_compute: bool = False,
              command: str | None = None, groups: bool = True,
              group_tokens: Sequence[int] | None = None) -> tuple[ClusterSpec, CostModel]:
    """Measure this machine; return (ClusterSpec, CostModel) and write ``out`` (JSON) when given.

    nproc: local CPU ranks to spawn (default 4; ignored under torchrun, which sets the world).
    methods: softmax methods to fit (default: all of them); heads/kv_heads/head_dim: the attention
    shape timed ([1, s, H, D] per rank, fp32 on CPU); layers: coefficients are per layer times this.
    quick: short lengths, few repeats, one method's compute fit shared by all (for tests).
    share_compute: time only the first method's single-rank kernel and share its fit (on one rank
    every softmax method runs the same local block kernel; their timings differ only by noise).
    groups: also time real packed steps of every method on every group size and store the fitted
    corrections as ``group_scale`` (the last phase; see the module docstring). group_tokens: tokens
    per rank of those steps (default: the two largest ``seq_lens``, one common factor per (method, g);
    three or more give separate attention / rest factors; --quick: the largest).
    """
    launched = launched_by_torchrun()
    nproc = int(os.environ["WORLD_SIZE"]) if launched else (4 if nproc is None else nproc)
    kv_heads = heads if kv_heads is None else kv_heads
    methods = list(methods) if methods is not None else [m for m in METHODS if m in SOFTMAX_METHODS]
    seq_lens = list(seq_lens) if seq_lens is not None else list(QUICK_SEQ_LENS if quick else DEFAULT_SEQ_LENS)
    _check_args(nproc, methods, seq_lens, heads, kv_heads, head_dim, layers)
    reps = repeats if repeats is not None else (1 if quick else 3)
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
    shape = (heads, kv_heads, head_dim)
    timed = methods[:1] if quick or share_compute else methods
    mid = sorted(seq_lens)[len(seq_lens) // 2]
    with launched_process_group() if launched else LocalRanks() as ranks:
        run, world, rank0 = _runner(nproc, ranks)
        meas: dict = {"shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers},
                      "seq_lens": seq_lens, "repeats": reps, "world_size": world, "timed_methods": timed,
                      "loadavg_before": _loadavg()}
        tokens = list(group_tokens) if group_tokens else sorted(seq_lens)[-1 if quick else -2:]

        def overlap():  # a message about as long as the compute it should hide under
            bw = _fit_links(meas["links"]).get((world, "p2p"), (1e9, 0.0))[0] if world > 1 else 1e9
            tc = meas["compute"][timed[0]][seq_lens.index(mid)] * meas["core sharing"][world]
            return run(phase_overlap, methods[0], mid, shape, min(64 << 20, max(64 << 10, bw * tc)), reps)

        def group_steps():  # real packed steps, modelled with everything measured so far
            cluster, cost = build_models(meas, methods)
            batches = [(g, tailed_docs(g * c) * (world // g)) for c in tokens for g in cluster.group_sizes()]
            return measure_group_scales(run, cluster, cost, methods, batches, shape, reps)[1]

        steps = [("compute", lambda: run(phase_compute, timed, seq_lens, shape, reps)),
                 ("core sharing", lambda: run(phase_slowdown, methods[0], mid, shape, reps)),
                 ("links", lambda: run(phase_links, QUICK_MESSAGE_BYTES if quick else DEFAULT_MESSAGE_BYTES, reps)),
                 ("overlap", overlap), ("memory", lambda: run(phase_memory, methods[0], mid, shape)),
                 ("kernels", lambda: run(phase_kernels, methods, max(seq_lens), shape,
                                         [1 << i for i in range(1, world.bit_length())], reps))]
        if groups:
            steps.append(("groups", group_steps))

        for name, fn in progress_track(steps, "calibrate", progress and rank0):
            meas[name] = fn()
        meas["loadavg_after"] = _loadavg()
        cluster, cost = build_models(meas, methods)
        if out is not None and rank0:
            save_calibration(out, cluster, cost, measurements=_jsonable(meas), command=command)
    return cluster, cost


def _loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages (outside load perturbs CPU timings; recorded with them)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _fit_links(links: dict) -> dict:
    return {(int(g), kind): fit_link(*zip(*rows)) for g, kinds in links.items() for kind, rows in kinds.items()}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def tailed_docs(total: int) -> list[int]:
    """A long-tailed packed batch of ``total`` tokens: documents of 1/2, 1/4, 1/8 and the rest."""
    docs = [total // 2, total // 4, total // 8]
    return [x for x in docs + [total - sum(docs)] if x > 0]


def measure_group_scales(run, cluster: ClusterSpec, cost: CostModel, methods: Sequence[str],
                         batches: Sequence[tuple[int, list[int]]], shape: tuple[int, int, int], repeats: int,
                         *, warmup: int = 1, seed: int = 0) -> tuple[dict, list[dict]]:
    """Measured corrections per (method, group size): ``({method: {g: (k_attn, k_rest)}}, rows)``.

    ``batches``: ``(g, seq_lens)`` pairs; each is planned with :func:`static_plan` (groups of g tiling
    ``cluster``'s world, sequences balanced over them) for every method that can run on g ranks
    (g = 1 once, for all methods), executed by ``run(phase_plans, ...)`` on the world's ranks and
    timed (median of the slowest rank). Each row keeps the measured time and the modelled parts
    ``A`` (attention) and ``R`` (the rest) of the plan's time under ``cost`` without group scales
    (:meth:`.assign.Table.plan_parts`: the slowest group, or on shared cores the plan's work bound
    when that binds); :func:`fit_group_scale` turns a (method, g)'s rows into its factors.
    """
    from seqpar.schedulers.assign import Assignment, Table
    from seqpar.schedulers.greedy import static_plan

    cost = cost.without_group_scales()
    rows = []
    for g, lens in batches:
        todo = [m for m in (methods[:1] if g == 1 else methods) if cost.supports(m, g)]
        plans = [static_plan(lens, cluster, g, m, cost) for m in todo]
        res = run(phase_plans, [p.to_json() for p in plans], lens, shape, seed, warmup, repeats)
        for m, p, (times, _) in zip(todo, plans, res):
            owner = np.empty(len(lens), dtype=np.int64)
            for index, grp in enumerate(p.groups):
                owner[list(grp.seqs)] = index
            a, r = Table(cluster, cost, [m]).plan_parts(Assignment([(x.start, x.size) for x in p.groups], owner),
                                                        np.asarray(lens, dtype=np.float64))
            measured = float(np.median(times))
            rows.append({"method": m, "group_size": g, "tokens": sum(lens), "measured_s": measured,
                         "modelled_s": a + r, "attn_s": a, "rest_s": r, "ratio": measured / (a + r)})
    return group_scales_from(rows, methods), rows


def fit_group_scale(rows: Sequence[dict]) -> tuple[float, float]:
    """``(k_attn, k_rest)`` with ``measured ≈ k_attn·attn_s + k_rest·rest_s`` over ``rows``
    (non-negative least squares on relative error). Two factors need at least three rows (two
    points fit any two factors exactly, noise included); with fewer, or when the rows cannot tell
    the two parts apart (a factor fits to 0), one common factor: the median ratio."""
    common = float(np.median([r["measured_s"] / (r["attn_s"] + r["rest_s"]) for r in rows]))
    if len(rows) >= 3:
        t = np.array([r["measured_s"] for r in rows])
        a = np.array([[r["attn_s"], r["rest_s"]] for r in rows]) / t[:, None]
        ka, kr = _nonneg_lstsq(a, np.ones(len(rows)))
        if ka > 0 and kr > 0:
            return float(ka), float(kr)
    return common, common


def group_scales_from(rows: Sequence[dict], methods: Sequence[str]) -> dict:
    """``{method: {g: (k_attn, k_rest)}}`` from :func:`measure_group_scales` rows (g = 1 for every method)."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["method"], int(r["group_size"])), []).append(r)
    out: dict = {}
    for (m, g), rs in sorted(by.items(), key=lambda kv: kv[0][1]):
        k = fit_group_scale(rs)
        for mm in (methods if g == 1 else [m]):
            out.setdefault(mm, {})[g] = k
    return out


def build_models(meas: dict, methods: Sequence[str]) -> tuple[ClusterSpec, CostModel]:
    """Turn the measurements of :func:`calibrate` into (ClusterSpec, CostModel)."""
    from seqpar.schedulers.cost import method_buffers

    shape, lens, world = meas["shape"], meas["seq_lens"], int(meas["world_size"])
    h, hk, d, layers = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["layers"]
    mem = meas["memory"]
    fits = {m: fit_compute(lens, t) for m, t in meas["compute"].items()}
    first = next(iter(fits.values()))
    costs = []
    for m in methods:
        a1, a2, b = fits.get(m, first)
        tok, full = method_buffers(m, h * d, hk * d, h, mem["element_size"])
        costs.append((m, MethodCost(alpha1=a1 * layers, alpha2=a2 * layers, beta1=b * layers,
                                    m_token=mem["bytes_per_token"] * layers + tok, m_model=float(mem["rss"]),
                                    m_token_full=full)))
    cost = CostModel(methods=tuple(costs), hidden=h * d, kv_hidden=hk * d, layers=layers, n_heads=h,
                     bytes_per_element=int(mem["element_size"]), grad_bytes_per_element=4)  # fp32 dK,dV, dq
    if meas.get("kernels"):  # emulated efficiency = 1 / (kernel factor x the schedule's imbalance)
        from seqpar.schedulers.replay_table import causal_imbalance

        cost = cost.with_kernel_scales({m: {int(n): 1.0 / (eff * causal_imbalance(m, int(n))) for n, eff in by.items()}
                                        for m, by in meas["kernels"].items() if m in methods})
    if meas.get("groups"):
        cost = cost.with_group_scales(group_scales_from(meas["groups"], methods))
    links = _fit_links(meas["links"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    rpn = local if is_power_of_two(local) and world % local == 0 else world
    intra = [links[(g, "p2p")] for g in sorted({g for g, _ in links}) if g <= rpn]
    inter = [links[(g, "p2p")] for g in sorted({g for g, _ in links}) if g > rpn] or intra
    cpu = mem["device"] == "cpu"

    cores = usable_cores() if cpu else (os.cpu_count() or 1)
    fields = {"world_size": world, "ranks_per_node": rpn, "memory_per_rank": float(mem["memory_per_rank"]),
              "cores": float(cores) if cpu else 0.0,
              # ranks sharing cores cannot run faster than one alone: a measured factor below 1 is noise
              "compute_slowdown_by_ranks": tuple((int(k), max(1.0, float(v)) if cpu else float(v))
                                                 for k, v in meas["core sharing"].items()),
              "measured_links": tuple((g, kind, bw, lat) for (g, kind), (bw, lat) in sorted(links.items())),
              "overlap_factor": float(meas["overlap"]["overlap"])}
    if intra:
        fields.update(intra_node_bandwidth=intra[-1][0], latency_intra=intra[-1][1],
                      inter_node_bandwidth=inter[-1][0], latency_inter=inter[-1][1])
    return ClusterSpec(**fields), cost
