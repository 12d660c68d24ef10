#!/usr/bin/env bash
# The prepared GPU check: the most valuable GPU figures first, each step under its own time cap and
# the whole run within 10 minutes, every result written to OUT_DIR as soon as it exists.
# Usage, from the repository root of a checkout (no install needed: the packages import from here,
# torch and transformers must be installed; peers are measured where importable):
#     bash bench/gpu_check.sh OUT_DIR [TOTAL_SECONDS]
# Steps, in order of value:
#   1. train: the report's first section on CUDA, its quick shape (Qwen3-0.6B widths, 1 layer,
#      Trainer runs of stock and the library, each its own process), bf16 autocast; peaks from
#      torch.cuda.max_memory_allocated / max_memory_reserved
#   2. ce: cross-entropy from logits at [16384, 128256] bf16 (targets: <= 4 ms, in-place peak <= 1 GiB)
#   3. lce: the hidden-state loss at N=16384, H=4096, V=128256 bf16 against Liger and cut-cross-entropy
#   4. the CUDA-only tests (cross-entropy, activation offloading, the step-memory estimate)
#   5. ac estimate: ac_policies.estimate(device="cuda") against max_memory_allocated over one step,
#      dense (no policy; hidden-state loss + full) and MoE (non_moe), bf16, 4096 tokens (target 5%;
#      bench/sections/ac/estimate_cuda.py)
#   6. logprobs: token log-probs and distillation at N=16384, H=4096, V=128256 bf16 against TRL's
#      Triton kernels and Liger's fused linear JSD
#   7. the hidden-state loss's chunk rows (512, 1024, 4096), while time is left
#   8. dist: vocabulary-parallel losses over every GPU (2 or more GPUs only)
#   9. ac offload: peak device memory and step time of the offload action against checkpoint and
#      torch's save_on_cpu on 8 MLP blocks, [8192, 2048] bf16 (bench/sections/ac/offload.py)
#  10. train context: the longest context within +8GiB, stock+hf_gc vs the library, while time is left
#  11. train headline at full depth: Qwen3-0.6B's 28 layers, one row of 8192 tokens, stock+hf_gc vs the
#      library (long_context: tiled MLPs, checkpoints offloaded on CUDA), tokens/s and peaks
# Files in OUT_DIR: log.txt (everything printed), train/, ce/, lce/, logprobs/ (report folders:
# report.md, report.json), train.json, ce.json, lce.json, logprobs.json, cuda_tests.txt,
# ac_estimate_cuda.json, lce_chunks_*.json, dist.json, ac_offload.json, train_context/, train_context.json,
# train_headline/, train_headline.json.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [TOTAL_SECONDS]}
total=${2:-600}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/log.txt"
status=0
python - <<'PY' 2>&1 | tee "$log"
import importlib.util, platform, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
for peer in ("liger_kernel", "cut_cross_entropy", "trl", "triton", "transformers"):
    print(peer, "importable" if importlib.util.find_spec(peer) else "missing")
from functional_ce.weight_grad import fp32_out_matmul_supported
print("fp32-output bf16 matmul on cuda:", fp32_out_matmul_supported(torch.device("cuda"), torch.bfloat16))
PY

# step NAME CAP COMMAND...: run COMMAND under min(CAP, the time left), logging; skip it when under 20 s are left.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((total - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s of the ${total} s left" | tee -a "$log"
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "== $name (cap ${cap} s, ${left} s left)" | tee -a "$log"
    timeout "$cap" "$@" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

step "1 train quick, bf16 autocast" 150 python -m bench --device cuda --only train --no-progress \
    --train-dtype bf16 --out "$out/train" --json "$out/train.json"
step "2 ce [16384, 128256] bf16" 150 python -m bench --device cuda --only ce --no-progress \
    --ce-shape 16384,128256 --ce-repeats 10 --out "$out/ce" --json "$out/ce.json"
step "3 lce N=16384 H=4096 V=128256 bf16" 150 python -m bench --device cuda --only lce --no-progress \
    --lce-shape 16384,4096,128256 --lce-repeats 10 --lce-profile --out "$out/lce" --json "$out/lce.json"
step "4 CUDA-only tests" 90 bash -o pipefail -c "python -m pytest -q -m cuda -p no:cacheprovider tests/functional_ce/test_ce_cuda.py \
    tests/ac_policies/test_ac_offload.py tests/ac_policies/estimate/test_estimate_cuda.py | tee '$out/cuda_tests.txt'"
step "5 ac estimate vs max_memory_allocated, bf16, 4096 tokens" 90 python -m bench.sections.ac.estimate_cuda \
    --seq 4096 --out "$out"
step "6 logprobs N=16384 H=4096 V=128256 bf16" 180 python -m bench --device cuda --only logprobs --no-progress \
    --logprobs-tables logprobs,distill_hidden --logprobs-n 16384 --logprobs-h 4096 --logprobs-v 128256 \
    --logprobs-repeats 5 --out "$out/logprobs" --json "$out/logprobs.json"
for rows in 512 1024 4096; do
    step "7 lce chunk rows $rows" 40 python -m bench --device cuda --only lce --no-progress \
        --lce-shape 16384,4096,128256 --lce-repeats 10 --lce-variants functional_ce.linear_cross_entropy \
        --lce-chunk-size "$rows" --out "$out/lce_chunks_$rows" --json "$out/lce_chunks_$rows.json"
done
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    worlds=2; [ "$gpus" -ge 4 ] && worlds=2,4
    step "8 dist over $gpus GPUs" 300 python -m bench --device cuda --only dist --no-progress --dist-worlds "$worlds" \
        --dist-shape 16384,128256 --dist-hidden-shape 16384,4096,128256 --dist-hidden-dtype bf16 \
        --out "$out/dist" --json "$out/dist.json"
else
    echo "== 8 dist: skipped, the vocabulary-parallel benchmark needs 2 or more GPUs and this machine has $gpus" \
        | tee -a "$log"
fi
step "9 ac offload vs checkpoint vs save_on_cpu, 8 x [8192, 2048] bf16" 90 python -m bench.sections.ac.offload \
    --layers 8 --hidden 2048 --tokens 8192 --dtype bf16 --repeats 5 --json "$out/ac_offload.json"
step "10 train context within +8GiB, stock+hf_gc vs library" 240 python -m bench --device cuda --only train \
    --no-progress --train-dtype bf16 --train-variants stock+hf_gc --train-steps 2 --train-context on \
    --train-budget +8GiB --train-context-limit 65536 --out "$out/train_context" --json "$out/train_context.json"
step "11 train headline, 28 layers, 8192 tokens, bf16" 180 python -m bench --device cuda --only train --no-progress \
    --train-models --train-dtype bf16 --train-headline 8192 --train-layers 28 --train-steps 3 \
    --out "$out/train_headline" --json "$out/train_headline.json"
echo "== done in ${SECONDS} s (status $status)" | tee -a "$log"
exit $status
