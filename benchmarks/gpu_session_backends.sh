#!/usr/bin/env bash
# One GPU session for the attention backends (one H100 or H200), at most SESSION_S seconds (default
# 530: under the device tool's 600 s limit for one command, the machine's start not counted):
#
#   OUT=DIR bash benchmarks/gpu_session_backends.sh        # DIR defaults to /tmp/seqpar_gpu_backends
#
# 1. the GPU tests of the backends against float64 (cudnn, torch_cuda's direct flash calls
#    and packed calls, the dispatch order, a backward with a gradient on the lse, the Triton dk/dv
#    kernel's Hopper-only configurations forced one by one), pytest -m gpu; 1b. FlashAttention-4's,
#    bf16, when the run carried .f4 (benchmarks/gpu_carry_flash4.sh packs it: the machine has no PyPI);
# 2. `seqpar bench --emulate 8` at 64K tokens (zigzag_ring, ring, striped_ring; Llama-3-8B heads,
#    bf16, causal) with the committed dispatch table: "before";
# 3. benchmarks/gpu_backends.py: every backend forced on every block the ring, zigzag, striped and
#    token_ring schedules issue at 8K and 32K tokens per GPU (D = 128, and D = 64 / 256 at 8K),
#    forward with lse and backward from the merged out / lse, first call apart, TFLOP/s, the
#    two-step correctness check against float64; it REWRITES seqpar/kernels/dispatch_table.json
#    (from what it timed, also when it is stopped: its JSON is saved after every block);
# 4. the same emulation with the regenerated table: "after".
# Each step gets what is left of the session minus what the later steps need, and a failing step
# does not stop the others. $OUT gets 7 files (the device tool returns at most 8): session.log
# (versions, device, commit, every command, the short logs, the summary), gpu_tests.log,
# gpu_backends.log, gpu_backends.json, dispatch_table.json, emulate_before.json, emulate_after.json.
# Commit the table and the JSONs from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/seqpar_gpu_backends}
SESSION_S=${SESSION_S:-530}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$LOG"; }
# seconds for a step: at most $1, leaving $2 for the steps after it (never below 10)
budget() { local left=$(( SESSION_S - ($(date +%s) - start) - $2 )); (( left > $1 )) && left=$1; (( left < 10 )) && left=10; echo $left; }
run() { stamp "\$ $*"; "$@"; }

# FlashAttention-4 when benchmarks/gpu_carry_flash4.sh packed it and the run carried .f4 (no PyPI there).
# Steps 1 and 2 run without it (TREE_ONLY): installed, it ranks first in automatic dispatch, so step 1
# would test it in place of the backends it names and step 2 would not be the committed baseline.
# Its compiled kernels are kept on disk, so steps 1b, 3 and 4 compile each configuration once.
F4=.f4/flash4_site.tar.xz
TREE_ONLY=(env PYTHONPATH="$PWD")
S1=(170 360)  # step 1: at most 170 s, leaving 360 s for the steps after it
if [ -s "$F4" ]; then
    S1=(120 410)  # step 1b's 45 s come out of step 1, not out of the emulation
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/seqpar_flash4_cache
    F4_SITE=/tmp/seqpar_flash4_site
    rm -rf "$F4_SITE" && mkdir -p "$F4_SITE" &&
        python -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" "$F4" "$F4_SITE" &&
        export PYTHONPATH=$PYTHONPATH:$F4_SITE:$F4_SITE/nvidia_cutlass_dsl/dsl_packages  # the CuTe DSL's .pth
    stamp "unpacked $F4 into $F4_SITE: rc=$?"
fi

{
    echo "command: OUT=$OUT SESSION_S=$SESSION_S bash benchmarks/gpu_session_backends.sh"
    echo "date: $(date -u)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git on this machine)')"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>&1
    python - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("gpu", *((torch.cuda.get_device_name(), torch.cuda.get_device_capability()) if torch.cuda.is_available() else ["none"]))
for dist in ("triton", "flash-attn", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
try:
    from seqpar.kernels.flash4 import _load
    print("flash4 backend:", _load()[1] or "importable")
except Exception as exc:
    print("flash4 backend:", type(exc).__name__, exc)
EOF
} 2>&1 | tee -a "$LOG"

stamp "1. GPU tests of the backends"  # timeout's SIGINT stops pytest with its summary of what ran
run "${TREE_ONLY[@]}" timeout -s INT -k 15 "$(budget "${S1[@]}")" python -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels.py tests/test_varlen_kernels.py tests/test_kernels_lse_grad.py tests/test_triton_block_shapes.py \
    -k "(fused_backends or torch_cuda or dispatch_per_pass or test_cuda or gpu_hopper) and not flash4" \
    > "$OUT/gpu_tests.log" 2>&1
stamp "   rc=$? $(tail -1 "$OUT/gpu_tests.log")"
if [ -n "${F4_SITE:-}" ]; then  # FlashAttention-4 compiles each configuration on its first call: bf16 only
    stamp "1b. FlashAttention-4's GPU tests (bf16; step 3 checks it on every block)"
    run timeout -s INT -k 15 "$(budget 45 360)" python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels.py \
        -k "fused_backends and flash4 and bf16 and (q17k17 or q9k23) and not mqa8x1" >> "$OUT/gpu_tests.log" 2>&1
    stamp "   rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi

EMULATE=(--emulate 8 --methods zigzag_ring,ring,striped_ring --seq-lens 65536 --heads 32 --kv-heads 8
         --head-dim 128 --dtype bfloat16 --causal yes --repeats 3 --warmup 1 --no-progress)
stamp "2. emulate before (committed table)"
run "${TREE_ONLY[@]}" timeout "$(budget 80 280)" python -m seqpar bench "${EMULATE[@]}" --json "$OUT/emulate_before.json" >> "$LOG" 2>&1
stamp "   rc=$?"

stamp "3. every backend on every block; writes the dispatch table"
t3=$(budget 300 80)
run timeout "$t3" python benchmarks/gpu_backends.py --out "$OUT" --table seqpar/kernels/dispatch_table.json \
    --budget-s $(( t3 - 60 )) > "$OUT/gpu_backends.log" 2>&1
rc=$?
stamp "   rc=$rc $(tail -1 "$OUT/gpu_backends.log")"
if [ $rc -ne 0 ] && [ -s "$OUT/gpu_backends.json" ]; then  # stopped: the table from the blocks it timed
    run timeout 60 python benchmarks/gpu_backends.py --table-from "$OUT/gpu_backends.json" \
        --table seqpar/kernels/dispatch_table.json >> "$LOG" 2>&1
    stamp "   table from the saved blocks: rc=$?"
fi
cp seqpar/kernels/dispatch_table.json "$OUT/dispatch_table.json"

stamp "4. emulate after (regenerated table)"
run timeout "$(budget 80 15)" python -m seqpar bench "${EMULATE[@]}" --json "$OUT/emulate_after.json" >> "$LOG" 2>&1
stamp "   rc=$?"

python - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("emulate_before", "emulate_after"):
    p = out / f"{name}.json"
    if p.exists():
        for r in json.loads(p.read_text())["rows"]:
            print(f"{name}: {r['method']:12s} busiest rank {r.get('slowest_ms') or float('nan'):8.1f} ms")
p = out / "gpu_backends.json"
if p.exists():
    doc = json.loads(p.read_text())
    print("gpu_backends complete:", doc.get("complete"), "rows", len(doc["rows"]), "skipped", len(doc["skipped"]),
          "failed", doc.get("failed"))
    for c in doc["checks"]:
        print("check", c["backend"], c["head_dim"], "ok" if c.get("ok") else c.get("error") or c.get("errors"))
    for row in doc["rows"]:
        if (row["tokens_per_rank"], row["rows"], row["keys"], row["mask"], row["head_dim"]) == (8192, 8192, 8192, "none", 128):
            for p_ in ("forward", "backward"):
                print(p_, "8K x 8K none D=128 TFLOP/s:", {n: round(r.get("tflops", 0)) for n, r in row[p_]["backends"].items()})
EOF
stamp "done"
