"""``model_patches.enable_linear_cross_entropy``: ``model(**batch, labels=...)`` through the
hidden-state loss while training, the model's own forward otherwise, and Hugging Face
``Trainer`` giving the same losses and weights with and without it."""

from __future__ import annotations

import pytest
import torch

from model_patches import enable_linear_cross_entropy
from tests.support.batches import padded_batch
from tests.support.tiny_models import LOSS_VOCAB, tiny_loss_model


def test_training_call_with_labels_returns_the_loss_without_logits():
    model = tiny_loss_model("llama")
    batch = padded_batch()
    expected = model(**batch).loss
    with enable_linear_cross_entropy(model) as handle:
        out = model(**batch)
        assert out.logits is None
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        positional = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        torch.testing.assert_close(positional.loss, expected, rtol=1e-5, atol=1e-6)
        assert model(**batch, return_dict=False)[0].shape == ()
        # Every other call is the model's own: no labels, evaluation, no gradients.
        assert model(input_ids=batch["input_ids"]).logits.shape == (*batch["input_ids"].shape, LOSS_VOCAB)
        with torch.no_grad():
            assert model(**batch).logits is not None
        model.eval()
        assert model(**batch).logits is not None
        model.train()
        assert handle.active
    assert not handle.active and "forward" not in model.__dict__
    assert model(**batch).logits is not None


def test_gradients_equal_the_model_own_loss():
    model = tiny_loss_model("qwen3", tie_word_embeddings=True)
    batch = padded_batch(seed=3)
    model(**batch, num_items_in_batch=17).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with enable_linear_cross_entropy(model):
        model(**batch, num_items_in_batch=17).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_unsupported_models_and_double_patching_are_refused():
    with pytest.raises(ValueError, match="logit"):
        enable_linear_cross_entropy(tiny_loss_model("cohere", logit_scale=0.5))
    model = tiny_loss_model("llama")
    handle = enable_linear_cross_entropy(model)
    with pytest.raises(ValueError, match="already patched"):
        enable_linear_cross_entropy(model)
    handle.remove()
    handle.remove()  # a no-op
    enable_linear_cross_entropy(model).remove()


def _train(patched: bool, out_dir) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    from transformers import Trainer, TrainingArguments, default_data_collator

    model = tiny_loss_model("llama")
    handle = enable_linear_cross_entropy(model) if patched else None
    rows = []
    for i in range(8):
        b = padded_batch(seed=10 + i, b=1, t=12)
        b["labels"][0, : i % 5] = -100  # a different number of label tokens per example
        rows.append({k: v[0] for k, v in b.items()})
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=0.05, lr_scheduler_type="constant", optim="sgd", logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    if handle is not None:
        handle.remove()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.model_accepts_loss_kwargs


def test_trainer_with_gradient_accumulation_gives_the_same_losses_and_weights(tmp_path):
    """Trainer passes num_items_in_batch (accumulation over micro-batches with different token
    counts): the patched model must see and honour it as the model's own loss does."""
    own_losses, own_weights, own_accepts = _train(False, tmp_path / "own")
    our_losses, our_weights, our_accepts = _train(True, tmp_path / "ours")
    assert own_accepts and our_accepts
    assert len(our_losses) == 2
    assert our_losses == pytest.approx(own_losses, rel=1e-5)
    for name, w in own_weights.items():
        torch.testing.assert_close(our_weights[name], w, rtol=1e-5, atol=1e-6, msg=name)
