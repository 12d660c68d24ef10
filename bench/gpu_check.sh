#!/usr/bin/env bash
# The prepared GPU check: CUDA-only tests and the GPU benchmarks, every figure written to $1.
# Usage: bash bench/gpu_check.sh OUT_DIR   (about 15 minutes on one H200, after install)
# Peers (Liger-Kernel, cut-cross-entropy, TRL) are measured where importable. Files in OUT_DIR:
# log.txt (everything printed), lce.json, lce_chunks_{512,1024,4096}.json, cuda_tests.txt,
# ce.json, logprobs.json and, on a machine of 2 or more GPUs, dist.json.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
log="$out/log.txt"
python - <<'PY' 2>&1 | tee "$log"
import importlib.util, platform, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
for peer in ("liger_kernel", "cut_cross_entropy", "trl", "triton", "transformers"):
    print(peer, "importable" if importlib.util.find_spec(peer) else "missing")
from functional_ce.weight_grad import fp32_out_matmul_supported
print("fp32-output bf16 matmul on cuda:", fp32_out_matmul_supported(torch.device("cuda"), torch.bfloat16))
PY
status=0
lce=(--device cuda --only lce --no-progress --lce-shape 16384,4096,128256 --lce-repeats 10)
# 1. Hidden-state loss at the issue's GPU shape, every variant side by side, with a profile.
timeout 300 python -m bench "${lce[@]}" --lce-profile --json "$out/lce.json" 2>&1 | tee -a "$log" || status=1
# 2. Chunk rows of functional_ce at that shape (auto is measured above).
for rows in 512 1024 4096; do
    timeout 50 python -m bench "${lce[@]}" --lce-variants functional_ce.linear_cross_entropy \
        --lce-chunk-size "$rows" --json "$out/lce_chunks_$rows.json" 2>&1 | tee -a "$log" || status=1
done
# 3. CUDA-only tests (bf16 parity of both losses, in-place gradient aliasing, inductor on the device).
timeout 120 python -m pytest -q -m cuda -p no:cacheprovider tests/test_ce_cuda.py 2>&1 \
    | tee "$out/cuda_tests.txt" || status=1
# 4. Cross-entropy from logits at its issue shape.
timeout 200 python -m bench --device cuda --only ce --no-progress --ce-shape 16384,128256 --ce-repeats 10 \
    --json "$out/ce.json" 2>&1 | tee -a "$log" || status=1
# 5. Token log-probs with entropy and distillation from hidden states at the GPU shape, against the
#    full path, TRL's Triton kernels and Liger's fused linear JSD.
timeout 420 python -m bench --device cuda --only logprobs --no-progress --logprobs-tables logprobs,distill_hidden \
    --logprobs-n 16384 --logprobs-h 4096 --logprobs-v 128256 --logprobs-repeats 5 \
    --json "$out/logprobs.json" 2>&1 | tee -a "$log" || status=1
# 6. Vocabulary-parallel losses over every GPU of the machine (nccl, one process per GPU).
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    worlds=2; [ "$gpus" -ge 4 ] && worlds=2,4
    timeout 600 python -m bench --device cuda --only dist --no-progress --dist-worlds "$worlds" \
        --dist-shape 16384,128256 --dist-hidden-shape 16384,4096,128256 --dist-hidden-dtype bf16 \
        --json "$out/dist.json" 2>&1 | tee -a "$log" || status=1
else
    echo "dist: skipped, the vocabulary-parallel benchmark needs 2 or more GPUs and this machine has $gpus" \
        | tee -a "$log"
fi
exit $status
