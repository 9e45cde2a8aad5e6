"""ring-flash-attention's zigzag step on one GPU, with its transfers as paced copies beside the kernels.

    python benchmarks/gpu_overlap.py --out DIR            # needs a CUDA device and CuPy (NVRTC)
    python benchmarks/gpu_overlap_report.py A.json B.json   # its results page (markdown, stdout)

Target (c) of the replay's validation compares seqpar's replay of ``zigzag_ring`` with
ring-flash-attention's published 8-GPU rows (8K tokens per GPU, 32 query / 8 K,V heads, D = 128,
bf16, causal; ``results/replay_ringflash.md``). Timing NCCL needs two GPUs; what a rank does on its
own GPU can be timed on one:

- **beside**: a zigzag block (torch's FlashAttention-2 kernel, native GQA) while a transfer
  stand-in runs on another stream: the block's slowdown (the replay's ``OVERLAP_SLOWDOWN``) and
  when the transfer ends;
- **step**: one rank's zigzag forward and backward in ring-flash-attention's order of launches and
  waits: its blocks, its fp32 merge of each block (``_update_out_and_lse``, op by op or scripted as
  it declares it) and gradient sums, its transfers (K,V bf16 on every step but the last; dK,dV
  fp32 on every backward step, a second ring), ``Work.wait`` as a stream-event wait; against the
  ideal (the causal 8K call), as the published table does.

Every timing queues its launches behind ``gpu_kernel_times.hold``, so it holds the GPU's time, not the host's,
as ring-flash-attention's benchmark (calls back to back) does. The NCCL stand-in (``paced_copy``,
CuPy RawKernel) copies the message's bytes in device memory with ``ctas`` thread blocks of 512
threads, held to ``rate`` bytes per second by the GPU's global timer; ``exclusive`` reserves 200 KB
of shared memory per block so that no attention block shares its SM, as NCCL's blocks do not
(NVIDIA/nccl#1656). How many blocks NCCL's send/recv uses for an NVLink peer is not known here,
hence 2 to 32. What one GPU cannot show: the peer GPU, NVLink, NCCL's protocol.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernel_times import _machine as machine_info  # noqa: E402
from gpu_kernel_times import hold, timed  # noqa: E402

TOKENS, HQ, HKV, D, N = 8192, 32, 8, 128, 8  # ring-flash-attention's published setting, per GPU
KV_BYTES = 2 * TOKENS * HKV * D * 2  # K and V, bf16: what a step sends forward and backward
DKV_BYTES = 2 * TOKENS * HKV * D * 4  # dK and dV, fp32: the backward's second ring
RESERVE = 200 * 1024  # shared memory per stand-in block when exclusive

PACED = r"""
extern "C" __global__ void paced_copy(const int4* __restrict__ src, int4* __restrict__ dst, long long n16,
                                      long long chunk, long long ns_per_chunk, unsigned long long* stamps) {
    extern __shared__ int4 reserve[];
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    long long i = 0;
    for (long long base = (long long)blockIdx.x * chunk; base < n16; base += (long long)gridDim.x * chunk, ++i) {
        long long end = base + chunk < n16 ? base + chunk : n16;
        for (long long j = base + threadIdx.x; j < end; j += 8LL * blockDim.x) {
            int4 r[8];  // eight loads in flight per thread before the stores
#pragma unroll
            for (int u = 0; u < 8; ++u) if (j + u * (long long)blockDim.x < end) r[u] = src[j + u * (long long)blockDim.x];
#pragma unroll
            for (int u = 0; u < 8; ++u) if (j + u * (long long)blockDim.x < end) dst[j + u * (long long)blockDim.x] = r[u];
        }
        if (ns_per_chunk > 0) {
            unsigned long long target = t0 + (unsigned long long)((i + 1) * ns_per_chunk);
            do {
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now < target) __nanosleep(256);
            } while (now < target);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        stamps[2 * blockIdx.x] = t0;
        stamps[2 * blockIdx.x + 1] = now;
        if (n16 < 0) reserve[0] = src[0];
    }
}
"""


class Transfer:
    """Paced copies on a stream: ``launch(nbytes, stream)`` starts one; rate None: full speed."""

    CHUNK = 1 << 14  # 16-byte words per block and pacing interval (256 KB)

    def __init__(self, rate: float | None, ctas: int, exclusive: bool, src: torch.Tensor, dst: torch.Tensor):
        import cupy as cp

        self.cp, self.rate, self.ctas, self.exclusive = cp, rate, ctas, exclusive
        self.kernel = cp.RawKernel(PACED, "paced_copy")
        if exclusive:
            self.kernel.max_dynamic_shared_size_bytes = RESERVE
        self.src, self.dst = src, dst
        self.stamps = torch.zeros(2 * ctas, dtype=torch.int64, device="cuda")
        self.streams: dict = {}  # torch stream handle -> CuPy's view of it (made once: host time)

    def launch(self, nbytes: int, stream: torch.cuda.Stream) -> None:
        if nbytes > self.src.numel():
            raise ValueError(f"nbytes: {nbytes} is more than the {self.src.numel()} bytes of the buffers")
        n16 = nbytes // 16
        per_cta = self.rate / self.ctas if self.rate else 0.0
        ns = int(self.CHUNK * 16 / per_cta * 1e9) if per_cta else 0
        ext = self.streams.get(stream.cuda_stream)
        if ext is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream (it ran, CuPy 14.2, 2026-11-26)
                warnings.simplefilter("ignore", DeprecationWarning)
                ext = self.streams[stream.cuda_stream] = self.cp.cuda.ExternalStream(stream.cuda_stream)
        with ext:
            self.kernel((self.ctas,), (512,), (np.uint64(self.src.data_ptr()), np.uint64(self.dst.data_ptr()),
                                               np.int64(n16), np.int64(self.CHUNK), np.int64(ns),
                                               np.uint64(self.stamps.data_ptr())),
                        shared_mem=RESERVE if self.exclusive else 0)

    def label(self) -> str:
        rate = f"{self.rate / 1e9:.0f} GB/s" if self.rate else "full speed"
        return f"{self.ctas} blocks, {rate}, {'exclusive' if self.exclusive else 'shared'} SMs"


def flash_blocks() -> dict:
    """name -> (forward fn, backward fn) of each block of the zigzag schedule and of the ideal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(rows, cols, causal):
        q = torch.randn(1, HQ, rows, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k, v = (torch.randn(1, HKV, cols, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                for _ in range(2))
        dout = torch.randn(1, HQ, rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = sdpa(q, k, v, is_causal=causal, enable_gqa=True)

        def fwd():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad():
                return sdpa(q, k, v, is_causal=causal, enable_gqa=True)

        def bwd():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        return fwd, bwd

    half = TOKENS // 2
    return {"diag": make(TOKENS, TOKENS, True), "q_full": make(TOKENS, half, False),
            "q_half": make(half, TOKENS, False)}


def beside(blocks, transfer: Transfer | None, which: str, block: str, reps: int, first: str = "transfer",
           nbytes: int | None = None) -> dict:
    """Median ms of the block alone or beside a transfer (started ``first``), and of the transfer."""
    fn = blocks[block][0 if which == "fwd" else 1]
    cur, side = torch.cuda.current_stream(), torch.cuda.Stream()
    out = {"block_ms": [], "transfer_end_ms": []}
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        e0, eb, et = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        hold(cur)
        e0.record(cur)
        side.wait_event(e0)
        if transfer is not None and first == "transfer":
            transfer.launch(nbytes, side)
        fn()
        eb.record(cur)
        if transfer is not None and first == "block":
            transfer.launch(nbytes, side)
        et.record(side)
        torch.cuda.synchronize()
        out["block_ms"].append(e0.elapsed_time(eb))
        out["transfer_end_ms"].append(e0.elapsed_time(et))
    return {k: statistics.median(v[2:]) for k, v in out.items()}


def transfer_alone(transfer: Transfer, nbytes: int, reps: int) -> float:
    side = torch.cuda.Stream()
    ms = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold(side)
        a.record(side)
        transfer.launch(nbytes, side)
        b.record(side)
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms[2:])


def _merge_math(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold a block's output and log-sum-exp into the running ones (fp32): the weight of the new
    block is sigmoid(block_lse - lse), the new log-sum-exp lse + log(1 + exp(block_lse - lse))."""
    block_out = block_out.to(torch.float32)
    new_out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    new_lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return new_out, new_lse


class Merge:
    """ring-flash-attention's per-step fp32 work on one rank's 8K tokens, in the layout of the
    kernel's output (heads first): the forward's fold of each block into the running output and
    log-sum-exp (:func:`_merge_math`, its ``_update_out_and_lse``: ``eager`` op by op, or
    ``scripted`` with ``torch.jit.script`` as it declares it, which lets TorchScript fuse the ops on a
    GPU), written back only where the step covers half the rows; the backward's fp32 sums of dq, dK,
    dV; the first step's casts to fp32 and the last casts back to bf16."""

    def __init__(self, mode: str):
        self.fn = _merge_math if mode == "eager" else torch.jit.script(_merge_math)
        self.out = torch.zeros(1, HQ, TOKENS, D, device="cuda")
        self.lse = torch.zeros(1, HQ, TOKENS, 1, device="cuda")
        self.block_lse = torch.zeros(1, HQ, TOKENS, 1, device="cuda")
        self.dq = torch.zeros(1, HQ, TOKENS, D, device="cuda")
        self.dkv = [torch.zeros(1, HKV, TOKENS, D, device="cuda") for _ in range(2)]

    def forward(self, block_out: torch.Tensor, rows: slice, first: bool) -> None:
        if first:
            self.out = block_out.to(torch.float32)
            return
        blse = self.block_lse[:, :, : block_out.shape[2]]
        if rows.start == 0:  # the whole rows: the running tensors are replaced
            self.out, self.lse = self.fn(self.out, self.lse, block_out, blse)
        else:
            o, lse = self.fn(self.out[:, :, rows], self.lse[:, :, rows], block_out, blse)
            self.out[:, :, rows], self.lse[:, :, rows] = o, lse

    def backward(self, grads, rows: slice, cols: slice, first: bool, dkv_ready: torch.cuda.Event | None) -> None:
        dq, dk, dv = grads
        if first:
            self.dq, self.dkv = dq.to(torch.float32), [dk.to(torch.float32), dv.to(torch.float32)]
            return
        self.dq[:, :, rows] += dq
        if dkv_ready is not None:  # d_kv_comm.wait(): the previous step's dK, dV have arrived
            torch.cuda.current_stream().wait_event(dkv_ready)
        self.dkv[0][:, :, cols] += dk[:, :, : cols.stop - cols.start]
        self.dkv[1][:, :, cols] += dv[:, :, : cols.stop - cols.start]

    def finish(self, bwd: bool) -> None:
        for t in [self.dq, *self.dkv] if bwd else [self.out]:
            t.to(torch.bfloat16)


def zigzag_rank(blocks, rank: int, transfer: Transfer | None, merge: str | None) -> tuple[float, float]:
    """(forward ms, backward ms) of rank ``rank`` of N in ring-flash-attention's zigzag order;
    ``merge``: None (the blocks only) or a :class:`Merge` mode."""
    cur, side = torch.cuda.current_stream(), torch.cuda.Stream()
    m = Merge(merge) if merge else None
    half = TOKENS // 2
    full, second = slice(0, TOKENS), slice(half, TOKENS)

    def send(nbytes):  # batch_isend_irecv: NCCL's stream waits for the current one; returns Work's event
        side.wait_stream(cur)
        if transfer is not None:
            transfer.launch(nbytes, side)
        ev = torch.cuda.Event()
        ev.record(side)
        return ev

    def kind(step):
        return "diag" if step == 0 else ("q_full" if step <= rank else "q_half")

    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    hold(cur)
    e[0].record(cur)
    for step in range(N):
        kv = send(KV_BYTES) if step + 1 != N else None
        out = blocks[kind(step)][0]()
        if m:
            m.forward(out, second if kind(step) == "q_half" else full, step == 0)
        if kv is not None:
            cur.wait_event(kv)
    if m:
        m.finish(False)
    e[1].record(cur)
    dkv = None
    for step in range(N):
        kv = send(KV_BYTES) if step + 1 != N else None
        grads = blocks[kind(step)][1]()
        if m:
            cols = slice(0, half) if kind(step) == "q_full" else full
            m.backward(grads, second if kind(step) == "q_half" else full, cols, step == 0, dkv)
        elif dkv is not None:
            cur.wait_event(dkv)
        if kv is not None:
            cur.wait_event(kv)
        dkv = send(DKV_BYTES)
    cur.wait_event(dkv)
    if m:
        m.finish(True)
    e[2].record(cur)
    torch.cuda.synchronize()
    return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])


def ideal_ms(blocks, reps: int) -> tuple[float, float]:
    """The causal 8K call, forward and backward, 10 calls back to back per timing: ring-flash-
    attention's "theoretic flash_attn" (its benchmark times a loop of calls)."""
    fwd = timed(blocks["diag"][0], 0, reps, calls=10)["median_ms"]
    bwd = timed(blocks["diag"][1], 0, reps, calls=10)["median_ms"]
    return fwd, bwd


# (blocks, rate GB/s or None for full speed, exclusive SMs) of the transfer stand-in
BESIDE = [(2, 160, True), (4, 80, True), (4, 160, True), (4, 320, True), (8, 160, True), (16, 160, True),
          (32, 160, True), (4, 160, False), (4, None, True)]
# (label, Merge mode or None, stand-in (blocks, GB/s, exclusive) or None)
STEPS = [("kernels", None, None), ("kernels + merge, eager", "eager", None),
         ("kernels + merge, scripted", "scripted", None),
         ("+ transfers, 4 blocks, 160 GB/s, eager", "eager", (4, 160, True)),
         ("+ transfers, 4 blocks, 160 GB/s, scripted", "scripted", (4, 160, True)),
         ("+ transfers, 16 blocks, 160 GB/s, eager", "eager", (16, 160, True)),
         ("+ transfers, 16 blocks, 160 GB/s, scripted", "scripted", (16, 160, True)),
         ("+ transfers, 32 blocks, 160 GB/s, scripted", "scripted", (32, 160, True))]


def run_beside(blocks, src, dst, reps: int) -> list[dict]:
    """Each block of the zigzag step beside each stand-in of :data:`BESIDE`, the transfer long enough
    to cover the block (its rate x the block's time alone x 1.25; full speed: the K,V message)."""
    rows = []
    for which in ("fwd", "bwd"):
        alone = beside(blocks, None, which, "q_full", reps)["block_ms"]
        for ctas, rate, excl in BESIDE:
            t = Transfer(rate * 1e9 if rate else None, ctas, excl, src, dst)
            nbytes = int(rate * 1e9 * alone * 1.25e-3) // 16 * 16 if rate else KV_BYTES
            row = {"pass": which, "block": "q_full", "ctas": ctas, "rate_gbs": rate, "exclusive": excl,
                   "bytes": nbytes, "block_alone_ms": alone, "transfer_alone_ms": transfer_alone(t, nbytes, reps)}
            for first in ("transfer", "block") if (ctas, rate, excl) == (4, 160, True) else ("transfer",):
                got = beside(blocks, t, which, "q_full", reps, first, nbytes)
                row[f"{first}_first"] = got
            row["slowdown"] = row["transfer_first"]["block_ms"] / alone - 1
            rows.append(row)
            print(f"beside {which} {t.label():40s} block {alone:6.3f} -> {row['transfer_first']['block_ms']:6.3f} ms "
                  f"({row['slowdown']:+.1%}); transfer alone {row['transfer_alone_ms']:6.3f}, "
                  f"ends at {row['transfer_first']['transfer_end_ms']:6.3f} ms", flush=True)
    return rows


def run_steps(blocks, src, dst, reps: int, ideal: tuple[float, float]) -> list[dict]:
    """Every rank's zigzag forward and backward under each variant of :data:`STEPS`."""
    rows = []
    for label, merge, spec in STEPS:
        t = Transfer(spec[1] * 1e9, spec[0], spec[2], src, dst) if spec else None
        for rank in range(N):  # warm-up (TorchScript profiles its first calls, then fuses)
            zigzag_rank(blocks, rank, t, merge)
        per_rank = []
        for rank in range(N):
            times = [zigzag_rank(blocks, rank, t, merge) for _ in range(reps)]
            per_rank.append([statistics.median(x[0] for x in times), statistics.median(x[1] for x in times)])
        fwd, step = max(r[0] for r in per_rank), max(r[0] + r[1] for r in per_rank)
        row = {"variant": label, "per_rank_ms": per_rank, "fwd_ms": fwd, "fwd_bwd_ms": step,
               "efficiency_fwd": N * ideal[0] / fwd, "efficiency_fwd_bwd": N * sum(ideal) / step}
        rows.append(row)
        print(f"step {label:45s} fwd {fwd:7.2f} ms ({row['efficiency_fwd']:.1%})  fwd+bwd {step:7.2f} ms "
              f"({row['efficiency_fwd_bwd']:.1%})", flush=True)
    return rows


def _machine() -> dict:
    import cupy

    return {**machine_info(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "cupy": cupy.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_overlap.json")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out: give the folder for gpu_overlap.json")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return 0
    t0 = time.perf_counter()
    doc = {"command": "python benchmarks/gpu_overlap.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": _machine(), "setting": {"tokens_per_gpu": TOKENS, "heads": HQ, "kv_heads": HKV, "head_dim": D,
                                             "world_size": N, "kv_bytes": KV_BYTES, "dkv_bytes": DKV_BYTES},
           "reps": args.reps}
    blocks = flash_blocks()
    src = torch.zeros(3 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for fwd, bwd in blocks.values():  # warm-up
        fwd(), bwd()
    doc["ideal_ms"] = ideal_ms(blocks, args.reps)
    doc["block_ms"] = {name: [timed(fn, 0, args.reps, calls=10)["median_ms"] for fn in pair]
                       for name, pair in blocks.items()}  # per call, 10 back to back: [forward, backward]
    doc["kernels_sum_ms"] = [[sum(doc["block_ms"]["diag" if s_ == 0 else ("q_full" if s_ <= r else "q_half")][p_]
                                  for s_ in range(N)) for p_ in (0, 1)] for r in range(N)]
    m = Merge("scripted")
    blse = m.block_lse[:, :, :TOKENS]
    for _ in range(3):
        m.fn(m.out, m.lse, blocks["q_full"][0](), blse)
    graph = str(torch.jit.last_executed_optimized_graph())
    doc["scripted_merge_fused"] = any(k in graph for k in ("TensorExprGroup", "FusionGroup", "CudaFusionGroup"))
    print(f"ideal (causal {TOKENS}) fwd {doc['ideal_ms'][0]:.3f} ms, bwd {doc['ideal_ms'][1]:.3f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc["beside"] = run_beside(blocks, src, dst, args.reps)
    (out / "gpu_overlap.json").write_text(json.dumps(doc, indent=1) + "\n")
    doc["steps"] = run_steps(blocks, src, dst, max(3, args.reps // 2), doc["ideal_ms"])
    doc["after"], doc["seconds"] = _machine()["nvidia_smi"], time.perf_counter() - t0
    (out / "gpu_overlap.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'gpu_overlap.json'} in {doc['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
