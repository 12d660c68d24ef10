"""model_patches.causal_lm_loss against model(**batch, labels=...).loss on tiny real HF models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import model_patches
from tests.support.batches import grads, packed_batch, padded_batch
from tests.support.reference import model_loss_and_grads
from tests.support.tiny_models import LOSS_FAMILIES, tiny_loss_model


def _ours(model, batch, **kw):
    loss = model_patches.causal_lm_loss(model, chunk_size=7, **batch, **kw)
    loss.backward()
    return loss.detach(), grads(model)


def _assert_same(ref, ours, rtol=1e-4, atol=1e-6):
    (loss_r, g_r), (loss_o, g_o) = ref, ours
    assert loss_o.dtype == torch.float32
    torch.testing.assert_close(loss_o, loss_r.float(), rtol=rtol, atol=atol)
    assert g_o.keys() == g_r.keys()
    for name in g_r:
        torch.testing.assert_close(g_o[name], g_r[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", sorted(LOSS_FAMILIES))
def test_loss_and_gradients_match_the_models_own_loss(model_type):
    model = tiny_loss_model(model_type)
    batch = padded_batch()
    _assert_same(model_loss_and_grads(model, batch), _ours(model, batch))


def test_every_verified_model_type_is_tested_here():
    from model_patches.loss.linear_cross_entropy import VERIFIED_MODEL_TYPES

    assert VERIFIED_MODEL_TYPES <= set(LOSS_FAMILIES), sorted(VERIFIED_MODEL_TYPES - set(LOSS_FAMILIES))


def test_gemma2_softcapping_and_tied_embeddings_are_used():
    model = tiny_loss_model("gemma2", final_logit_softcapping=0.1)  # small enough to bite on tiny logits
    assert model.lm_head.weight is model.get_input_embeddings().weight
    batch = padded_batch(seed=3)
    ref = model_loss_and_grads(model, batch)
    _assert_same(ref, _ours(model, batch))
    model.config.final_logit_softcapping = None  # proves the cap matters: the loss changes
    assert not torch.allclose(model_patches.causal_lm_loss(model, **batch), ref[0], rtol=1e-3)


def test_num_items_in_batch_normalisation():
    model = tiny_loss_model("llama")
    batch = dict(padded_batch(), num_items_in_batch=torch.tensor(40))
    _assert_same(model_loss_and_grads(model, batch), _ours(model, batch))


def test_packed_row_with_shift_labels_and_position_ids():
    model = tiny_loss_model("qwen3")
    batch = dict(packed_batch(), use_cache=False)  # a cache turns off HF's packed-row detection
    ref_loss = model(**batch, labels=batch["shift_labels"]).loss  # labels only switch the loss on
    ref_loss.backward()
    ref = (ref_loss.detach(), grads(model))
    _assert_same(ref, _ours(model, batch))


def test_packed_row_loss_is_the_token_weighted_mean_of_its_documents():
    model = tiny_loss_model("llama")
    lengths = (5, 7, 4)
    packed = packed_batch(lengths)
    total = int((packed["shift_labels"] != -100).sum())
    got = model_patches.causal_lm_loss(model, **packed, num_items_in_batch=total)
    parts, start = [], 0
    for n in lengths:
        ids = packed["input_ids"][:, start:start + n]
        parts.append(model_patches.causal_lm_loss(model, input_ids=ids, labels=ids, num_items_in_batch=total))
        start += n
    torch.testing.assert_close(got, sum(parts), rtol=1e-4, atol=1e-5)


def test_biased_plain_linear_head_is_handled():
    model = tiny_loss_model("llama")
    head = nn.Linear(64, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    model.lm_head = head
    batch = padded_batch()
    _assert_same(model_loss_and_grads(model, batch), _ours(model, batch))


def test_bf16_model_matches_closely():
    model = tiny_loss_model("qwen2", dtype=torch.bfloat16)
    batch = padded_batch()
    _assert_same(model_loss_and_grads(model, batch), _ours(model, batch), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: tiny_loss_model("cohere", logit_scale=0.5), r"config.logit_scale=0.5"),
        (lambda: tiny_loss_model("granite", logits_scaling=4.0), r"config.logits_scaling=4.0"),
        (lambda: tiny_loss_model("qwen3_moe", output_router_logits=True), "router auxiliary loss"),
    ],
)
def test_transformed_heads_and_extra_losses_are_refused(make, match):
    model = make()
    with pytest.raises(ValueError, match=match):
        model_patches.causal_lm_loss(model, **padded_batch())


def test_wrapped_head_is_refused():
    model = tiny_loss_model("llama")
    model.lm_head = nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        model_patches.causal_lm_loss(model, **padded_batch())


def test_batch_without_labels_is_refused():
    model = tiny_loss_model("llama")
    batch = padded_batch()
    del batch["labels"]
    with pytest.raises(ValueError, match="needs labels"):
        model_patches.causal_lm_loss(model, **batch)


def test_unverified_model_type_warns_once_and_still_matches(caplog):
    from model_patches.loss import causal_lm_parts

    causal_lm_parts.warned_types.discard("starcoder2")
    model = tiny_loss_model("starcoder2")
    batch = padded_batch()
    with caplog.at_level("WARNING", logger="model_patches.loss.causal_lm_parts"):
        ours = _ours(model, batch)
        model_patches.causal_lm_loss(model, **batch)
    warned = [r for r in caplog.records if "starcoder2" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    _assert_same(model_loss_and_grads(model, batch), ours)


def test_fp32_model_under_bf16_autocast_matches_the_models_own_loss():
    model = tiny_loss_model("llama")
    batch = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = model(**batch).loss
    ref_loss.backward()
    ref = (ref_loss.detach(), grads(model))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model_patches.causal_lm_loss(model, chunk_size=7, **batch)
    loss.backward()
    # Both run the head in bf16 under autocast: equal up to bf16 rounding of the head matmuls.
    _assert_same(ref, (loss.detach(), grads(model)), rtol=2e-2, atol=2e-4)
