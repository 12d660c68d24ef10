"""The packing oracle over Transformers' causal-LM families: each correct or refused, never a leak.

Correct = packed logits equal each document run alone (max gap <= 1e-4, fp32); refused = an
error naming the module and the reason (a stateful mixer packing cannot run per document, masks
built outside masking_utils, absolute positions without per-document position_ids). ALiBi
families and the hybrid families whose mixers run per document are correct. Both entry points:
``enable_packing(model=...)`` (checked at entry) and plain ``enable_packing()`` (checked by the
forward). The default run covers a representative set with the outcome each must have; the
nightly profile (``-m "slow or not slow"``) sweeps every family the installed release can build.
"""

from __future__ import annotations

import pytest

from model_patches.testing.family_sweep import causal_lm_families, sweep_family

#: family (+ config overrides) -> the outcome it must have on every supported release.
REPRESENTATIVE: dict[str, tuple[dict, str]] = {
    "llama": ({}, "correct"),
    "gpt2": ({}, "correct"),  # absolute positions, given per-document position_ids
    "falcon": ({}, "correct"),  # rotary by default
    "falcon+alibi": ({"alibi": True}, "correct"),  # ALiBi from per-document positions
    "bloom": ({}, "correct"),
    "mpt": ({}, "correct"),  # ALiBi that does not read the mask
    "jamba": ({}, "correct"),  # Mamba mixers run per document
    "bamba": ({}, "correct"),  # Mamba-2
    "qwen3_next": ({}, "correct"),  # gated delta net
    "lfm2": ({}, "correct"),  # short convolutions
    "kimi_linear": ({}, "correct"),  # delta-attention mixer; its softmax attention class is named *LinearAttention
    "mamba": ({}, "correct"),  # no attention: the model hands its mixers the mask itself
    "rwkv": ({}, "refused"),  # time mixing with no per-document record
    "cpmant": ({}, "refused"),
}


@pytest.mark.parametrize("use_model", [True, False], ids=["model=", "plain"])
@pytest.mark.parametrize("family", list(REPRESENTATIVE))
def test_representative_families(family: str, use_model: bool) -> None:
    overrides, expected = REPRESENTATIVE[family]
    result = sweep_family(family.split("+")[0], use_model=use_model, **overrides)
    assert result.outcome == expected, result
    if expected == "refused":
        assert "pack" in result.detail and any(w in result.detail for w in ("ALiBi", "mixer", "outside masking_utils", "not supported")), result


@pytest.mark.slow
@pytest.mark.parametrize("use_model", [True, False], ids=["model=", "plain"])
def test_every_causal_lm_family_is_correct_or_refused(use_model: bool) -> None:
    results = [sweep_family(f, use_model=use_model) for f in causal_lm_families()]
    leaks = [r for r in results if r.outcome == "leak"]
    assert not leaks, f"silent leaks: {leaks}"
    counts = {o: sum(r.outcome == o for r in results) for o in ("correct", "refused", "not built")}
    assert counts["correct"] >= 40 and counts["refused"] >= 10, counts
