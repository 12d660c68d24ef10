"""The LOSS_MAPPING record: model(**batch, labels=...) through functional_ce, same loss and grads."""

from __future__ import annotations

import pytest
import torch

import model_patches
from model_patches.loss import chunked_loss
from tests.support.alloc_trace import AllocationTrace
from tests.support.batches import packed_batch, padded_batch
from tests.support.reference import model_loss_and_grads
from tests.support.tiny_models import LOSS_VOCAB, tiny_loss_model


@pytest.mark.parametrize("model_type, dtype", [("llama", torch.float32), ("gemma2", torch.float32),
                                                ("qwen3_moe", torch.bfloat16)])
def test_routed_loss_equals_transformers_loss(model_type, dtype):
    model = tiny_loss_model(model_type, dtype=dtype)
    batch = padded_batch()
    ref_loss, ref_grads = model_loss_and_grads(model, batch)
    with model_patches.enable_chunked_loss():
        assert model.loss_function is chunked_loss.chunked_causal_lm_loss
        loss, got = model_loss_and_grads(model, batch)
    # Same fp32 maths on the same logits: equal up to summation order.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    for name in ref_grads:
        torch.testing.assert_close(got[name], ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("extra", [{"num_items_in_batch": torch.tensor(17)}, {"num_items_in_batch": 17}])
def test_num_items_in_batch_and_shift_labels(extra):
    model = tiny_loss_model("qwen2")
    batch = dict(packed_batch(), use_cache=False, **extra)
    batch["labels"] = batch["shift_labels"]
    ref_loss, ref_grads = model_loss_and_grads(model, batch)
    with model_patches.enable_chunked_loss():
        loss, got = model_loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(got[name], ref_grads[name], rtol=1e-4, atol=1e-6)


def test_no_fp32_copy_of_the_logits_is_allocated(monkeypatch):
    import functional_ce.spec

    # "auto" chunks of 8 rows here, so that a chunk is not the whole (tiny) batch.
    monkeypatch.setattr(functional_ce.spec, "AUTO_CHUNK_BYTES", 8 * LOSS_VOCAB * 4)
    model = tiny_loss_model("llama", dtype=torch.bfloat16)
    batch = padded_batch(t=16)
    n_logits = 2 * 16 * LOSS_VOCAB

    def fp32_logit_sized(trace):
        return [r for r in trace.records if r[2] == torch.float32 and _numel(r[1]) >= n_logits]

    with AllocationTrace() as plain:
        model(**batch).loss.backward()
    assert fp32_logit_sized(plain), "the trace should see Transformers' fp32 logits copy without the patch"
    model.zero_grad(set_to_none=True)
    with model_patches.enable_chunked_loss(), AllocationTrace() as routed:
        model(**batch).loss.backward()
    assert not fp32_logit_sized(routed), f"fp32 [B, T, V] tensors allocated: {fp32_logit_sized(routed)[:3]}"


def test_handle_undoes_exactly_and_applying_twice_is_a_no_op():
    import transformers.modeling_utils as mu

    original = mu.LOSS_MAPPING
    first = model_patches.enable_chunked_loss()
    patched = mu.LOSS_MAPPING
    second = model_patches.enable_chunked_loss()
    try:
        _check_patched(mu, patched, first)
    finally:
        first.remove()
        second.remove()
    assert mu.LOSS_MAPPING is original
    assert [r.state for r in model_patches.chunked_loss_status()] == ["available"]


def _check_patched(mu, patched, first):
    from transformers import trainer
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    assert mu.LOSS_MAPPING is patched, "applying twice must not stack a second patch"
    assert patched["ForCausalLM"] is chunked_loss.chunked_causal_lm_loss
    assert patched["ForConditionalGeneration"] is chunked_loss.chunked_causal_lm_loss
    assert patched["ForMaskedLM"] is LOSS_MAPPING["ForMaskedLM"]
    # The Trainer (5.x) decides how to count num_items_in_batch by identity with ForCausalLMLoss.
    if hasattr(trainer, "LOSS_MAPPING"):
        assert trainer.LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss
    assert [r.state for r in model_patches.chunked_loss_status()] == ["applied"]
    first.remove()
    assert mu.LOSS_MAPPING is patched, "the second handle still holds the patch"


def test_version_gate_and_probe():
    from model_patches.registry import record_status

    (row,) = record_status(chunked_loss.LOSS_RECORDS, version="4.46.0")
    assert row.state == "skipped" and "4.46.0" in row.reason

    def old_style(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        return logits.sum()

    reason = chunked_loss._probe_loss_mapping({"ForCausalLM": old_style})
    assert reason and "shift_labels" in reason
    assert chunked_loss._probe_loss_mapping({"ForMaskedLM": old_style}) == "it has no 'ForCausalLM' entry"
    assert chunked_loss._probe_loss_mapping([]) is not None


def test_no_valid_label_gives_zero_instead_of_nan():
    model = tiny_loss_model("llama")
    batch = padded_batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    assert torch.isnan(model(**batch).loss)  # Transformers: 0 / 0
    with model_patches.enable_chunked_loss():
        loss = model(**batch).loss
    assert loss.item() == 0.0


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
