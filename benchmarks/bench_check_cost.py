"""Cost of the default rank agreement check (seqpar.comm.agreement), on CPU gloo ranks.

Two measurements, each repeated (``--repeats``, default 3) and reported as the median:

1. **Step time** with and without the check: ``zigzag_ring``, causal, fwd+bwd, T = 8192 global tokens
   at N = 2 (B=1, 8 heads, D=64, fp32, 1 thread per rank), the two settings interleaved call by call
   so that a change in the machine's load hits both alike. Target: the check costs at most 1% of the
   step. (The difference of two step times of seconds is within noise; the per-call latency below
   is the precise number, and ``overhead`` = latency / step time.)
2. **Per-call latency** of the check alone at N = 2, 4, 8 (``--ns``), for the alternatives the design
   was chosen from (per call, on every rank):

   - ``default``: the fields of a realistic call (every argument described), hashed, and a 56-byte
     state (any failure, smallest and largest digest) combined in ceil(log2 N) rounds of one message
     each way (what ``seqpar.attention`` does by default);
   - ``digest_to_all``: the previous default, the 32-byte digest sent point to point to every other
     member and received from each (N - 1 messages each way in one round);
   - ``digest_allgather``: the same digest through gloo's all-gather (a collective: a dead or silent
     member cannot be named, and its size could pair with another rank's payload gather);
   - ``full_fingerprint``: the 8 KB JSON fingerprint all-gathered and decoded on every call (the
     earlier opt-in ``check_ranks=True``);
   - ``header_per_step``: the alternative of a 32-byte header exchanged with both ring neighbours
     before each of the 2N steps of a ring call (fwd + bwd), so the receiver validates sizes first;
   - ``fields_only``: the host work of the default check without any message (describing the
     arguments and hashing them).

   Each is reported as the mean per call and as the 10th percentile of the calls (those that found
   the cores free: on a shared machine the mean mostly measures the neighbours).
3. **Host CPU per message** at N = 2: 1023 32-byte sends and as many receives posted at once between
   the two ranks (the previous default's traffic per call at N = 1024), the process CPU time per
   send/receive pair (gloo's threads included): what a check of N - 1 messages per call costs the
   host at large N, against ceil(log2 N) messages for the default.

Writes ``benchmarks/results/check_cost.{md,json}``. Run it on a quiet machine (check ``uptime``).

    python benchmarks/bench_check_cost.py                   # ~2-4 min on 2 cores
    python benchmarks/bench_check_cost.py --calls 200 --ns 2,4 --out /tmp   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LARGE_N = 1024  # the largest group seqpar simulate projects
ESTIMATE_MS_PER_CALL = 1.0  # per call, 8 ranks of one node each with a core (not measurable here)
NCCL_ESTIMATE = """## Estimate for NCCL, 8 GPUs, 32 layers (arithmetic, not measured here)

Group created with backend="cpu:gloo,cuda:nccl" (what init_process_group() creates when no backend
is named): the check runs on the CPU and never waits for the GPU.

- Step time from published numbers: NVIDIA NeMo's long-sequence results (LLAMA2-7B, FP8, H100,
  context parallelism) reach 536-610 model TFLOPS per GPU for 32K-1M tokens. FLOPs per token of a
  Llama-2-7B shape (P = 6.7e9, L = 32, d = 4096), causal: 6P + 6LdT.
  32K tokens on 8 GPUs: 32768 x (4.02e10 + 2.58e10) = 2.16e15 FLOPs / (8 x 610e12) = 0.44 s.
  128K tokens: 131072 x (4.02e10 + 1.03e11) = 1.88e16 FLOPs / (8 x 555e12) = 4.2 s.
- Calls per step: 32 attention forwards, 64 with layers recomputed in backward.
- Per call: {ms:g} ms (3 rounds of one small message each way + 16 us of host work; see the
  contended measurements above, 10th percentiles).
- Host time per step: 64 x {ms:g} ms = {host:g} ms: 14.5% of the 0.44 s step, 1.5% of the 4.2 s step if
  the GPU waited for it; it does not while the host runs ahead (a layer's forward keeps the GPUs
  busy 4.6 ms at 32K tokens, 44 ms at 128K): expected device-visible cost ~0 (host-bound jobs only).
- backend="nccl" alone: the digest goes through an NCCL all-reduce and reading it back waits for the
  device; the GPU then idles ~0.2 ms per call until the host launches the next kernels:
  64 x 0.2 ms = 13 ms, 3% of 0.44 s, 0.3% of 4.2 s, not hidden.
""".replace("{host:g}", "64")


def _step_times(seq_len: int, heads: int, head_dim: int, calls: int) -> dict:
    """Rank 0's wall time of each fwd+bwd call, with and without the check, interleaved."""
    import torch.distributed as dist

    import seqpar

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, heads, head_dim, generator=gen) for _ in range(4)]
    q, k, v, dout = (seqpar.shard(t, method="zigzag_ring", check_ranks=False) for t in full)
    out = {True: [], False: []}
    for i in range(2 * calls + 2):
        check = bool(i % 2)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dist.barrier()
        t0 = time.perf_counter()
        o = seqpar.attention(*leaves, method="zigzag_ring", causal=True, check_ranks=check)
        o.backward(dout)
        t = time.perf_counter() - t0
        if i >= 2:  # the first pair warms up
            out[check].append(t)
    return {"check": out[True], "no_check": out[False]}


def _realistic_fields():
    """The fields seqpar.attention compares for a zigzag_ring call of 8 heads, D=64."""
    from seqpar.comm.fingerprint import call_fields

    x = torch.zeros(1, 4096, 8, 64, requires_grad=True)
    args = {"q": x, "k": x, "v": x, "group": None, "method": "zigzag_ring", "causal": True, "softmax_scale": None,
            "cu_seqlens": None, "backend": None, "stats": None, "grad_comm_dtype": None, "ulysses_degree": None,
            "ring_method": None, "check_ranks": None}
    return args, call_fields


def _latencies(calls: int) -> dict:
    """Seconds per call of each alternative (module docstring), on this rank."""
    import torch.distributed as dist

    from seqpar.comm import all_gather_stack, exchange, group_info
    from seqpar.comm.agreement import _decode, _encode
    from seqpar.comm.fingerprint import QUICK_TAG, field_digest, gather_rows, quick_agreement

    info = group_info(None)
    args, call_fields = _realistic_fields()

    def default():
        quick_agreement([info], "seqpar.attention", call_fields(args), False)

    def digest_to_all():
        row = torch.tensor([0, *field_digest("seqpar.attention", call_fields(args))], dtype=torch.int64)
        rows = gather_rows(info, row, tag=QUICK_TAG)
        bool(rows[:, 0].any()) or not bool((rows[:, 1:] == rows[0, 1:]).all())

    def digest_allgather():
        row = torch.tensor([0, *field_digest("seqpar.attention", call_fields(args))], dtype=torch.int64)
        rows = all_gather_stack(info, row)
        bool((rows[:, 1:] == rows[0, 1:]).all())

    def full_fingerprint():
        buf = _encode("seqpar.attention", call_fields(args), [], [])
        [_decode(r) for r in all_gather_stack(info, buf)]

    def header_per_step():
        h = torch.zeros(4, dtype=torch.int64)
        for _ in range(2 * info.size):
            exchange(info, [(h, 1, 99), (h, -1, 99)], [(torch.empty_like(h), -1, 99),
                                                       (torch.empty_like(h), 1, 99)]).wait()

    def fields_only():  # the host work of the default check without any message
        field_digest("seqpar.attention", call_fields(args))

    out = {}
    for name, fn in (("default", default), ("digest_to_all", digest_to_all), ("digest_allgather", digest_allgather),
                     ("full_fingerprint", full_fingerprint), ("header_per_step", header_per_step),
                     ("fields_only", fields_only)):
        for _ in range(10):
            fn()
        dist.barrier()
        each = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            each.append(time.perf_counter() - t0)
        each.sort()
        out[name] = statistics.mean(each)
        out[name + "_p10"] = each[len(each) // 10]  # the calls that found the cores free
    return out


def _message_cpu(messages: int, repeats: int = 7) -> float:
    """Process CPU seconds per 32-byte send/receive pair with the other rank of 2, ``messages`` of
    each posted at once (median of ``repeats``, the first two left out)."""
    import torch.distributed as dist

    peer, row, each = 1 - dist.get_rank(), torch.zeros(4, dtype=torch.int64), []
    for _ in range(repeats):
        bufs = [torch.empty_like(row) for _ in range(messages)]
        dist.barrier()
        c0 = time.process_time()
        works = [dist.irecv(b, src=peer, tag=i) for i, b in enumerate(bufs)]
        works += [dist.isend(row, dst=peer, tag=i) for i in range(messages)]
        for w in works:
            w.wait()
        each.append((time.process_time() - c0) / messages)
    return statistics.median(each[2:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed calls per setting per repeat")
    p.add_argument("--calls", type=int, default=1000, help="checks timed per latency measurement")
    p.add_argument("--ns", default="2,4,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    from seqpar.comm.pool import WorkerPool

    load = os.getloadavg()
    steps = {"check": [], "no_check": []}
    pool = WorkerPool(2)
    try:
        for _ in range(args.repeats):
            r = pool.run(_step_times, (args.seq_len, args.heads, args.head_dim, args.steps), timeout=3600)[0]
            for key, times in steps.items():
                times.append(statistics.median(r[key]))
        lat = {2: [pool.run(_latencies, (args.calls,), timeout=3600)[0] for _ in range(args.repeats)]}
        pair_cpu = statistics.median(pool.run(_message_cpu, (LARGE_N - 1,), timeout=3600))
    finally:
        pool.close()
    for n in [int(x) for x in args.ns.split(",") if int(x) != 2]:
        pool = WorkerPool(n)
        try:
            lat[n] = [pool.run(_latencies, (args.calls,), timeout=3600)[0] for _ in range(args.repeats)]
        finally:
            pool.close()
    result = {
        "config": {"method": "zigzag_ring", "causal": True, "N": 2, "T": args.seq_len, "heads": args.heads,
                   "D": args.head_dim, "dtype": "float32", "threads_per_rank": 1, "repeats": args.repeats,
                   "steps_per_repeat": args.steps, "calls": args.calls},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_before": load, "load_after": os.getloadavg()},
        "step_s": {k: statistics.median(v) for k, v in steps.items()}, "step_s_repeats": steps,
        "latency_us": {n: {k: 1e6 * statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in lat.items()},
        "latency_note": "per key: median over repeats of the mean per call; *_p10: of the 10th percentile",
        "message_pair_cpu_us": 1e6 * pair_cpu,
    }
    step = result["step_s"]["no_check"]
    result["overhead_of_step"] = result["latency_us"][2]["default"] * 1e-6 / step
    write(result, Path(args.out))
    return 0


def write(result: dict, out: Path) -> None:
    from seqpar.comm.fingerprint import agreement_offsets

    out.mkdir(parents=True, exist_ok=True)
    (out / "check_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    s, lat = result["step_s"], result["latency_us"]
    c = result["config"]
    lines = [
        "# Cost of the default rank agreement check",
        "",
        (f"`python benchmarks/bench_check_cost.py` on {result['machine']['cpus']} CPU cores "
         f"(load {result['machine']['load_before'][0]:.1f} before, {result['machine']['load_after'][0]:.1f} after), "
         f"torch {result['machine']['torch']}; medians of {c['repeats']} repeats."),
        "",
        f"## Step: {c['method']}, causal, N={c['N']}, T={c['T']}, {c['heads']} heads, D={c['D']}, fwd+bwd, CPU gloo",
        "",
        "| setting | step time (s) |",
        "|---|---|",
        f"| check on (default) | {s['check']:.3f} |",
        f"| check_ranks=False | {s['no_check']:.3f} |",
        "",
        (f"Per-call latency of the check at N=2: {lat[2]['default']:.0f} us = "
         f"**{100 * result['overhead_of_step']:.4f}% of the step** (target <= 1%). The two step times differ by "
         f"{100 * (s['check'] / s['no_check'] - 1):+.2f}%, within the run-to-run noise of a shared machine."),
        "",
        "## Per-call latency of the alternatives (us, per call, on every rank)",
        "",
        "Mean over the calls (in brackets: the 10th percentile, the calls that found the cores free).",
        "",
        ("| N | default (56 B state, log2 N rounds) | 32 B digest to every member (the previous default) | "
         "digest via gloo all-gather | full 8 KB fingerprint all-gathered + decoded | 32 B header with both "
         "neighbours per ring step (2N steps) | host work alone (fields + digest, no message) |"),
        "|---|---|---|---|---|---|---|",
    ]
    for n, r in sorted(lat.items()):
        lines.append("| " + " | ".join([str(n)] + [f"{r[k]:.0f} ({r[k + '_p10']:.0f})" for k in (
            "default", "digest_to_all", "digest_allgather", "full_fingerprint", "header_per_step",
            "fields_only")]) + " |")
    lines += ["", (f"N > {result['machine']['cpus']} ranks share {result['machine']['cpus']} cores: those rows are "
                   "upper bounds (each message waits for its receiver to be scheduled).")]
    pair = result["message_pair_cpu_us"]
    rounds = len(agreement_offsets(LARGE_N))
    lines += ["", f"## At N = {LARGE_N} (arithmetic from a measurement at N = 2)", "",
              (f"Host CPU per 32-byte send/receive pair, {LARGE_N - 1} of each posted at once between 2 ranks "
               f"(gloo's threads included): **{pair:.0f} us**. Per call and rank, sending the digest to every "
               f"member took {LARGE_N - 1} pairs: {(LARGE_N - 1) * pair / 1e3:.0f} ms of host CPU, more than a "
               f"layer's attention when each GPU holds a few thousand tokens (a host-bound job). The default's "
               f"{rounds} rounds: {rounds} pairs, {rounds * pair / 1e3:.2f} ms of CPU, plus {rounds} round "
               "trips of latency one after the other.")]
    lines += ["", NCCL_ESTIMATE.format(ms=ESTIMATE_MS_PER_CALL)]
    (out / "check_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
