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
# 3. Vocabulary-parallel losses over every GPU of the machine (nccl, one process per GPU).
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    worlds=2; [ "$gpus" -ge 4 ] && worlds=2,4
    timeout 600 python -m bench --device cuda --only dist --no-progress --dist-worlds "$worlds" \
        --dist-shape 16384,128256 --dist-hidden-shape 16384,4096,128256 --dist-hidden-dtype bf16 \
        --json "$out/bench_dist.json" --plot "$out/plots" 2>&1 | tee "$out/bench_dist.txt" || status=1
else
    echo "dist: skipped, the vocabulary-parallel benchmark needs 2 or more GPUs and this machine has $gpus" \
        | tee "$out/bench_dist.txt"
fi
exit $status
