#!/usr/bin/env bash
# The prepared GPU check: CUDA-only tests and the GPU benchmarks, every figure written to $1.
# Usage: bash bench/gpu_check.sh OUT_DIR   (about 5-8 minutes on one H200, after install)
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
python - <<'PY' > "$out/env.txt" 2>&1
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PY
cat "$out/env.txt"
status=0
# 1. CUDA-only tests (bf16 parity, in-place gradient aliasing, inductor compile on the device).
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/cuda_tests.txt" || status=1
# 2. GPU benchmarks at the issue shapes, CUDA allocator peaks, every figure in JSON.
timeout 300 python -m bench --device cuda --only ce lce --no-progress \
    --ce-shape 16384,128256 --ce-repeats 10 \
    --lce-shape 16384,4096,128256 \
    --json "$out/bench.json" --plot "$out/plots" 2>&1 | tee "$out/bench.txt" || status=1
exit $status
