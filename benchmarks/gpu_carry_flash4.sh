#!/usr/bin/env bash
# FlashAttention-4 for a GPU machine that cannot reach PyPI, in one file small enough to travel
# with the working tree (the device tool carries at most 64 MiB per call, tree included):
#
#   bash benchmarks/gpu_carry_flash4.sh            # here, with PyPI: writes .f4/flash4_site.tar.xz
#   device run, carry [".f4"]: OUT=$OUT bash benchmarks/gpu_session_backends.sh
#
# The `flash4` extra's pin (flash-attn-4==4.0.0b36) and what it needs beyond the GPU image (the
# CuTe DSL 4.8.1: its Python frontend (libs-core), MLIR bindings (libs-base) and CUDA 13 libraries,
# to match torch's cu130 there; apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels; 8 wheels), each
# unpacked into one site folder as pip would lay it out, then one tar compressed by xz with the x86
# filter and a 256 MiB dictionary: the CUDA 13 libraries' wheel alone is 92 MB zipped, 237 MB
# unpacked; xz's default preset makes 63.5 MB of them, over the limit with the tree; this makes
# 55 MiB of all 8. The session script unpacks the file to /tmp when it is there and puts the folder
# (and the `dsl_packages` folder the CuTe DSL's .pth would add) on PYTHONPATH. Takes about 5 minutes
# on 2 cores (the compression is single-threaded so the dictionary spans the largest library).
# Nothing here is imported by seqpar or run by its tests. Checked without a GPU: with Python 3.12
# and torch, `flash_attn.cute.interface` imports from the unpacked folder.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.f4
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PINS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
      nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
      quack-kernels==0.6.5)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d "$work/wheels" "${PINS[@]}"
mkdir -p "$work/site"
for whl in "$work"/wheels/*.whl; do
    python3 -m zipfile -e "$whl" "$work/site"
done
mkdir -p "$DEST" .git/info
grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null || echo "/$DEST/" >> .git/info/exclude
tar -C "$work/site" -cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB > "$DEST/flash4_site.tar.xz"
size=$(stat -c %s "$DEST/flash4_site.tar.xz")
# what travels besides: tracked files and untracked ones git does not ignore (those that exist)
tree=$(git ls-files -z --cached --others --exclude-standard |
       python3 -c "import os, sys; print(sum(os.path.getsize(f) for f in sys.stdin.read().split('\0') if os.path.isfile(f)))")
echo "$DEST/flash4_site.tar.xz: $(( size / 1048576 )) MiB; the tree $(( tree / 1048576 )) MiB; limit 64 MiB"
if (( size + tree > 64 * 1048576 )); then
    echo "too large to travel: leave flash4 out of this session" >&2
    exit 1
fi
