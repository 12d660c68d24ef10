"""``estimate(..., device="cuda")`` against ``torch.cuda.max_memory_allocated`` over one real
training step (bf16, AdamW), within 5%: dense without a policy, dense with the hidden-state loss
and ``full``, MoE with ``non_moe``. The measurement is :func:`bench.sections.ac.estimate_cuda.check_case`
(also step 5 of ``bench/gpu_check.sh``); skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

TOLERANCE = 0.05


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family,policy,hidden_state",
                         [("llama", "none", False), ("llama", "full", True), ("qwen3_moe", "non_moe", False)])
def test_estimate_is_within_5_percent_of_max_memory_allocated(family, policy, hidden_state):
    from bench.sections.ac.estimate_cuda import check_case

    r = check_case(family, policy, hidden_state, seq=2048)
    assert abs(r["ratio"] - 1) <= TOLERANCE, r
