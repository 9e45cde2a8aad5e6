"""seqpar against ring-flash-attention on identical block kernels: time per step and bytes sent.

ring-flash-attention (``pip install ring-flash-attn==0.1.8 --no-deps``; an optional benchmark
dependency, never one of seqpar's) calls ``flash_attn.flash_attn_interface._flash_attn_forward`` /
``_flash_attn_backward`` for its blocks. This script installs a ``flash_attn``-shaped module in
``sys.modules`` whose two functions run seqpar's CPU block kernel (``seqpar.kernels.block_forward``
/ ``block_backward`` forced to ``backend="torch_cpu"``; the backward copies its results into the
caller's dq/dk/dv buffers, as flash-attn writes into them), so both libraries run the same kernel on
the same blocks and differ only in their ring loop, merges and messages.

Both run zigzag ring attention over N gloo ranks (one thread each) on the same zigzag shards, a
step being one forward and one backward of the attention alone. The two are run in alternation
(the order swapped every round), so that the load of a shared machine falls on both alike; the
report gives each round's ratio seqpar / peer and their median. Bytes: every tensor handed to
``isend`` (``torch.distributed.P2POp``, which both use), per rank and step. Correctness: seqpar's
out and gradients against the peer's (max abs difference).

Usage (writes or updates benchmarks/results/peer_side_by_side.json and .md, keyed by ``--label``;
measure another checkout of seqpar by putting it first on PYTHONPATH)::

    pip install ring-flash-attn==0.1.8 --no-deps
    python benchmarks/peer_side_by_side.py --label after --rounds 5
    PYTHONPATH=/tmp/before python benchmarks/peer_side_by_side.py --label before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS = Path(__file__).resolve().parent / "results"


def install_flash_attn_shim() -> None:
    """A ``flash_attn.flash_attn_interface`` with flash-attn 2.6's private signatures over seqpar's
    CPU block kernel (causal is square here: zigzag's causal blocks are its diagonal ones)."""
    from seqpar.kernels import block_backward, block_forward

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                            window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
        out, lse = block_forward(q, k, v, scale=softmax_scale, mask="causal" if causal else "none",
                                 backend="torch_cpu")
        return out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                             deterministic=False, rng_state=None):
        grads = block_backward(dout, q, k, v, out, softmax_lse, scale=softmax_scale,
                               mask="causal" if causal else "none", backend="torch_cpu")
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)
        return dq, dk, dv

    def _varlen(*args, **kwargs):
        raise NotImplementedError("the shim serves the dense functions only")

    pkg = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    iface._flash_attn_varlen_forward = iface._flash_attn_varlen_backward = _varlen
    pkg.flash_attn_interface = iface
    pkg.__version__ = "2.6.3"
    sys.modules.setdefault("flash_attn", pkg)
    sys.modules.setdefault("flash_attn.flash_attn_interface", iface)
    # ring-flash-attention's package imports its transformers adapter, written for older transformers
    # releases (it imports names transformers 5 removed); the ring functions do not use it.
    adapters = types.ModuleType("ring_flash_attn.adapters")
    adapters.substitute_hf_flash_attn = adapters.update_ring_flash_attn_params = None
    sys.modules.setdefault("ring_flash_attn.adapters", adapters)


class _SentBytes:
    """Counts the bytes of every tensor handed to ``isend`` through ``torch.distributed.P2POp``."""

    def __init__(self) -> None:
        self.total, self._orig = 0, dist.P2POp
        counter = self

        class Counted(dist.P2POp):
            def __new__(cls, op, tensor, *args, **kwargs):
                if op is dist.isend:
                    counter.total += tensor.numel() * tensor.element_size()
                return super().__new__(cls, op, tensor, *args, **kwargs)

        dist.P2POp = Counted


# Ops that only make views or bare allocations (no data written), and the communication calls.
_NO_WRITE = {"alias", "transpose", "slice", "split", "squeeze", "unsqueeze", "view", "select", "narrow",
             "expand", "permute", "_unsafe_view", "as_strided", "t", "detach", "unbind", "lift_fresh",
             "empty", "empty_like", "new_empty", "empty_strided", "scalar_tensor", "send", "recv_", "recv",
             "barrier", "allreduce_", "_local_scalar_dense"}


class _Writes(TorchDispatchMode):
    """Bytes of the tensors every aten op of a step writes (outputs of out-of-place ops, the written
    tensor of in-place ones), views, bare allocations and communication left out; a ``copy_`` of a
    tensor onto itself (``a[i] += x`` ends in one) is skipped by torch and not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _NO_WRITE:
            return out
        if name == "copy_" and args[0].data_ptr() == args[1].data_ptr() and args[0].stride() == args[1].stride():
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.bytes += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        self.ops += 1
        return out


def _worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_flash_attn_shim()
    import ring_flash_attn

    import seqpar
    sent = _SentBytes()
    results = []
    for hkv in cfg["hkv"]:
        gen = torch.Generator().manual_seed(hkv)
        T, hq, d = cfg["T"], cfg["hq"], cfg["d"]
        dtype = getattr(torch, cfg["dtype"])
        glob = [torch.randn(1, T, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq)]
        q, k, v, dout = (seqpar.shard(x, method="zigzag_ring") for x in glob)

        def seqpar_step():
            qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
            out = seqpar.attention(qs, ks, vs, method="zigzag_ring", causal=True, backend="torch_cpu")
            out.backward(dout)
            return out, qs.grad, ks.grad, vs.grad

        def peer_step():
            qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
            out = ring_flash_attn.zigzag_ring_flash_attn_func(qs, ks, vs, causal=True)
            out.backward(dout)
            return out, qs.grad, ks.grad, vs.grad

        steps = {"seqpar": seqpar_step, "peer": peer_step}
        got = {name: fn() for name, fn in steps.items()}  # warm-up, and the correctness check
        diff = max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
                   for a, b in zip(got["seqpar"], got["peer"]))
        times = {name: [] for name in steps}
        nbytes = {}
        for r in range(cfg["rounds"]):
            for name in (("seqpar", "peer") if r % 2 == 0 else ("peer", "seqpar")):
                dist.barrier()
                before = sent.total
                t0 = time.perf_counter()
                steps[name]()
                dist.barrier()  # the step ends when both ranks have finished it
                times[name].append(time.perf_counter() - t0)
                nbytes[name] = sent.total - before
        written = {}
        for name, fn in steps.items():  # one more step each, every op's writes counted
            with _Writes() as w:
                fn()
            written[name] = {"bytes": w.bytes, "ops": w.ops}
        results.append({"hkv": hkv, "times": times, "bytes_sent": nbytes, "written": written, "max_abs_diff": diff})
    queue.put((rank, results))
    dist.destroy_process_group()


def _load() -> list[float]:
    return list(os.getloadavg())


def _versions() -> dict:
    import seqpar
    out = {"torch": torch.__version__, "python": platform.python_version(), "seqpar_path": str(Path(seqpar.__file__).parent)}
    try:
        import importlib.metadata as md
        out["ring_flash_attn"] = md.version("ring-flash-attn")
    except Exception as exc:  # noqa: BLE001 - report, not fail
        out["ring_flash_attn"] = repr(exc)
    root = Path(seqpar.__file__).resolve().parent.parent
    try:
        out["seqpar_commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "seqpar"],
                               capture_output=True, text=True, check=True).stdout.strip()
        out["seqpar_commit"] += " + uncommitted changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        out["seqpar_commit"] = "unknown"
    return out


def run(cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    load0 = _load()
    procs = [ctx.Process(target=_worker, args=(r, cfg["N"], port, cfg, queue)) for r in range(cfg["N"])]
    for p in procs:
        p.start()
    per_rank: dict = {}
    while len(per_rank) < len(procs):
        try:
            rank, res = queue.get(timeout=5)
            per_rank[rank] = res
        except Exception:  # noqa: BLE001 - queue.Empty: check that no rank died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed (its traceback is above)") from None
    for p in procs:
        p.join()
    rows = []
    for i, hkv in enumerate(cfg["hkv"]):
        res = [per_rank[r][i] for r in range(cfg["N"])]
        t = res[0]["times"]  # both ranks time the same barrier-to-barrier step
        ratios = [a / b for a, b in zip(t["seqpar"], t["peer"])]
        rows.append({"hkv": hkv, "seqpar_s": t["seqpar"], "peer_s": t["peer"],
                     "median_seqpar_s": statistics.median(t["seqpar"]), "median_peer_s": statistics.median(t["peer"]),
                     "ratios": ratios, "median_ratio": statistics.median(ratios),
                     "bytes_sent_per_rank": {name: [r["bytes_sent"][name] for r in res] for name in t},
                     "bytes_written_per_rank": {name: [r["written"][name]["bytes"] for r in res] for name in t},
                     "ops_per_rank": {name: [r["written"][name]["ops"] for r in res] for name in t},
                     "max_abs_diff": max(r["max_abs_diff"] for r in res)})
    return {"config": cfg, "rows": rows, "versions": _versions(), "machine": _machine(),
            "loadavg_start": load0, "loadavg_end": _load()}


def _machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def report(data: dict) -> str:
    lines = ["# seqpar against ring-flash-attention 0.1.8 on identical kernels", "",
             "Zigzag ring attention, one forward + backward step of the attention alone, causal, "
             "seqpar's CPU block kernel (torch_cpu) under both (ring-flash-attention through a `flash_attn` shim: "
             "benchmarks/peer_side_by_side.py). Runs alternate, order swapped each round; ratio = seqpar / peer "
             "per round, then the median. Bytes: every tensor handed to isend, per rank per step (seqpar's 56 more: "
             "the 7-number agreement check of its arguments across ranks before each call). Written: the bytes every "
             "aten op of one step writes (views, bare allocations, self-copies and communication left out; the "
             "block kernel's own writes, the same calls in both, included), per rank, and the number of those "
             "ops: a count, not a clock. Max rel diff: seqpar's out, dq, dk, dv against the peer's.", ""]
    for label, run_ in data.items():
        c, v, m = run_["config"], run_["versions"], run_["machine"]
        lines += [f"## {label}: seqpar {v['seqpar_commit']}", "",
                  f"N = {c['N']} gloo ranks (1 thread each), T = {c['T']}, Hq = {c['hq']}, D = {c['d']}, {c['dtype']}, "
                  f"{c['rounds']} rounds. Machine: {m['cpu']}, {m['cores']} cores, shared; load average "
                  f"(1/5/15 min) {', '.join(f'{x:.1f}' for x in run_['loadavg_start'])} at the start, "
                  f"{', '.join(f'{x:.1f}' for x in run_['loadavg_end'])} at the end. torch {v['torch']}, "
                  f"ring-flash-attn {v['ring_flash_attn']}, Python {v['python']}.", "",
                  "| Hkv | seqpar s/step (median) | peer s/step (median) | seqpar / peer per round | median ratio "
                  "| bytes sent per rank, seqpar | peer | MB written per rank, seqpar | peer | ops, seqpar | peer "
                  "| max rel diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run_["rows"]:
            b, w, n = r["bytes_sent_per_rank"], r.get("bytes_written_per_rank"), r.get("ops_per_rank")
            mb = (lambda name: ", ".join(f"{x / 1e6:.1f}" for x in w[name])) if w else (lambda name: "n/a")
            ops = (lambda name: ", ".join(str(x) for x in n[name])) if n else (lambda name: "n/a")
            lines.append(f"| {r['hkv']} | {r['median_seqpar_s']:.2f} | {r['median_peer_s']:.2f} | "
                         f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {r['median_ratio']:.3f} | "
                         f"{', '.join(str(x) for x in b['seqpar'])} | {', '.join(str(x) for x in b['peer'])} | "
                         f"{mb('seqpar')} | {mb('peer')} | {ops('seqpar')} | {ops('peer')} | {r['max_abs_diff']:.1e} |")
        lines += ["", f"Command: `{run_['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="the key of this run in the results (e.g. before, after)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="bfloat16: ring-flash-attention's own dtype (in float32 its backward accumulates into "
                         "a buffer it then overwrites: `dq_buffer.to(torch.float32)` is no copy there)")
    ap.add_argument("--out", type=Path, default=RESULTS / "peer_side_by_side.json")
    a = ap.parse_args(argv)
    cfg = {"N": a.nproc, "T": a.seq_len, "hq": a.heads, "hkv": a.kv_heads, "d": a.head_dim, "rounds": a.rounds,
           "dtype": a.dtype}
    result = run(cfg)
    result["command"] = " ".join(
        ([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else [])
        + ["python", "benchmarks/peer_side_by_side.py", *(argv if argv is not None else sys.argv[1:])])
    data = json.loads(a.out.read_text()) if a.out.exists() else {}
    data[a.label] = result
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(report(data))
    print(report({a.label: result}))


if __name__ == "__main__":
    main()
