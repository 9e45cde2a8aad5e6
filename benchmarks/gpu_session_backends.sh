#!/usr/bin/env bash
# One GPU session for the attention backends (one H100 or H200, about 7 minutes of device time):
#
#   OUT=DIR bash benchmarks/gpu_session_backends.sh        # DIR defaults to /tmp/seqpar_gpu_backends
#
# 1. the GPU tests of the backends against float64 (cudnn, flash4, torch_cuda's direct flash calls,
#    the dispatch order), pytest -m gpu;
# 2. `seqpar bench --emulate 8` at 64K tokens (zigzag_ring, ring, striped_ring; Llama-3-8B heads,
#    bf16, causal) with the committed dispatch table: "before";
# 3. benchmarks/gpu_backends.py: every backend forced on every block the ring, zigzag, striped and
#    token_ring schedules issue at 8K and 32K tokens per GPU (D = 128, and D = 64 / 256 at 8K),
#    forward with lse and backward from the merged out / lse, first call apart, TFLOP/s, the
#    two-step correctness check against float64; it REWRITES seqpar/kernels/dispatch_table.json;
# 4. the same emulation with the regenerated table: "after".
# Everything lands in $OUT (logs, JSON, the new table); commit the table and the JSON from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/seqpar_gpu_backends}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/session.log"; }

python - <<'EOF' | tee "$OUT/versions.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
EOF

stamp "1. GPU tests of the backends"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py \
    -k "cudnn or flash4 or torch_cuda or dispatch_per_pass" > "$OUT/gpu_tests.log" 2>&1
stamp "   rc=$? $(tail -1 "$OUT/gpu_tests.log")"

EMULATE=(--emulate 8 --methods zigzag_ring,ring,striped_ring --seq-lens 65536 --heads 32 --kv-heads 8
         --head-dim 128 --dtype bfloat16 --causal yes --repeats 3 --warmup 1 --no-progress)
stamp "2. emulate before (committed table)"
cp seqpar/kernels/dispatch_table.json "$OUT/dispatch_table_before.json"
timeout 100 python -m seqpar bench "${EMULATE[@]}" --json "$OUT/emulate_before.json" > "$OUT/emulate_before.log" 2>&1
stamp "   rc=$?"

stamp "3. every backend on every block; writes the dispatch table"
timeout 330 python benchmarks/gpu_backends.py --out "$OUT" --table seqpar/kernels/dispatch_table.json \
    --budget-s 240 > "$OUT/gpu_backends.log" 2>&1
stamp "   rc=$? $(tail -1 "$OUT/gpu_backends.log")"
cp seqpar/kernels/dispatch_table.json "$OUT/dispatch_table.json"

stamp "4. emulate after (regenerated table)"
timeout 100 python -m seqpar bench "${EMULATE[@]}" --json "$OUT/emulate_after.json" > "$OUT/emulate_after.log" 2>&1
stamp "   rc=$?"

python - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("emulate_before", "emulate_after"):
    p = out / f"{name}.json"
    if p.exists():
        for r in json.loads(p.read_text())["rows"]:
            print(f"{name}: {r['method']:12s} busiest rank {r.get('slowest_ms', float('nan')):8.1f} ms")
p = out / "gpu_backends.json"
if p.exists():
    doc = json.loads(p.read_text())
    for c in doc["checks"]:
        print("check", c["backend"], c["head_dim"], "ok" if c.get("ok") else c.get("error") or c.get("errors"))
    for row in doc["rows"]:
        if (row["tokens_per_rank"], row["rows"], row["keys"], row["mask"], row["head_dim"]) == (8192, 8192, 8192, "none", 128):
            for p_ in ("forward", "backward"):
                print(p_, "8K x 8K none D=128:", {n: round(r.get("tflops", 0)) for n, r in row[p_]["backends"].items()})
EOF
stamp "done"
