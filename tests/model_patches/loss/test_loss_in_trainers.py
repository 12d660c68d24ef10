"""The loss patches are used or refused, never silently bypassed, and stack with other code.

TRL's trainers install their own fused LM head on the model and compute the loss with it, so
``enable_linear_cross_entropy`` and ``enable_chunked_loss`` are refused when that head is there
(at enable time) or asked for (at the first step); removing a patch from under TRL's head leaves
training working; a keyword the loss path would skip is refused by name; any other training call
with labels that does not reach the library's loss is reported once per model. Call counts of
``functional_ce`` show which loss ran.
"""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

import functional_ce
import model_patches
from model_patches import enable_chunked_loss, enable_linear_cross_entropy
from tests.support.batches import padded_batch
from tests.support.tiny_models import tiny_loss_model


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Calls of the functional_ce losses the patches use, by name."""
    calls = {"linear_cross_entropy": 0, "cross_entropy": 0}
    for name in calls:
        real = getattr(functional_ce, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(functional_ce, name, counting)
    return calls


def test_a_keyword_the_loss_path_would_skip_is_refused_by_name_and_passed_through_elsewhere(counted):
    model = tiny_loss_model("llama")
    seen = []
    own = model.forward

    def forward_with_option(*args, special_option=None, **kwargs):  # a wrapper below the patch
        seen.append(special_option)
        return own(*args, **kwargs)

    model.forward = forward_with_option
    batch = padded_batch()
    with enable_linear_cross_entropy(model):
        with pytest.raises(ValueError, match=r"\['special_option'\]"):
            model(**batch, special_option=3)
        assert counted["linear_cross_entropy"] == 0
        with torch.no_grad():
            model(**batch, special_option=4)  # not the loss path: the wrapper below gets it unchanged
        assert seen == [4]
        model(**batch, num_items_in_batch=9, output_hidden_states=False)  # keywords Transformers takes
        assert counted["linear_cross_entropy"] == 1
    assert model.__dict__["forward"] is forward_with_option


def test_a_labelled_training_call_that_skips_the_loss_is_reported_once_per_model(counted):
    model, other = tiny_loss_model("llama"), tiny_loss_model("llama")
    batch = padded_batch()
    handles = [enable_linear_cross_entropy(model), enable_chunked_loss(model=other)]
    try:
        patched = model.forward
        plain = type(model).forward.__get__(model)

        def own_loss(**kwargs):  # code installed later that computes the loss itself
            logits = plain(**{k: v for k, v in kwargs.items() if k != "labels"}).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), kwargs["labels"][:, 1:].flatten())

        model.forward = own_loss
        with pytest.warns(UserWarning, match="enable_linear_cross_entropy.*without reaching"):
            model(**batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**batch)  # once per model
            other(**batch)  # the routed loss ran: no warning
            with torch.no_grad():
                model(**batch)  # not a training step
        assert counted["cross_entropy"] == 1 and counted["linear_cross_entropy"] == 0
        model.forward = patched
    finally:
        for handle in reversed(handles):
            handle.remove()


def test_remove_takes_the_patch_out_from_under_a_closure_wrapper():
    model = tiny_loss_model("llama")
    batch = padded_batch()
    with torch.no_grad():
        expected = model(**batch).logits
    handle = enable_linear_cross_entropy(model)
    below = model.forward
    calls = []

    def on_top(*args, **kwargs):  # captures the patched forward in its closure, as TRL's head does
        calls.append(1)
        return below(*args, **kwargs)

    model.forward = on_top
    handle.remove()
    assert not handle.active and model.__dict__["forward"] is on_top
    out = model(**batch)  # a training call with labels: the model's own forward, logits included
    assert out.logits is not None and len(calls) == 1
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected)

    held = enable_linear_cross_entropy(model)
    patched = model.forward
    model.forward = types.SimpleNamespace(patched=patched)  # holds the patch some other way
    with pytest.raises(ValueError, match="cannot be unwrapped"):
        held.remove()
    assert held.active  # refused, nothing changed
    model.forward = patched
    held.remove()
    assert not held.active


def test_remove_after_trainer_bf16_takes_the_patch_out_from_under_accelerate_autocast(tmp_path):
    """``Trainer(bf16=True)`` wraps the patched forward in Accelerate's autocast and fp32-output
    wrappers (a callable object down a ``__wrapped__`` chain); removing the patch afterwards keeps
    those wrappers and makes them call the model's own forward."""
    from transformers import Trainer, TrainingArguments

    from bench.harness.trainers import token_rows

    model = tiny_loss_model("llama")
    handle = enable_linear_cross_entropy(model)
    patched = model.forward
    rows = [{"input_ids": r, "labels": list(r)} for r in token_rows(4, 16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             bf16=True, report_to="none", save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows).train()
    assert model.__dict__["forward"] is not patched and model._original_forward is patched  # Accelerate's wrapper
    handle.remove()
    assert not handle.active and model._original_forward is not patched
    batch = padded_batch()
    out = model(**batch)  # a training call with labels: the model's own forward under bf16 autocast
    assert out.logits is not None and out.logits.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = type(model).forward(model, **batch)
    torch.testing.assert_close(out.logits, stock.logits.float())
    torch.testing.assert_close(out.loss, stock.loss.float())


# --- TRL ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("trl")
    from bench.harness.trainers import token_rows

    return token_rows(12, 16)


def _sft(model, tmp_path, rows, name):
    from bench.harness.trainers import sft_trainer

    return sft_trainer(model, tmp_path / name, rows)


def test_hidden_state_loss_under_sft_trainer_is_refused_in_either_order(tmp_path, rows, counted):
    from bench.harness.trainers import logged_losses

    plain = logged_losses(_sft(tiny_loss_model("llama"), tmp_path, rows, "plain"))

    late = tiny_loss_model("llama")
    trainer = _sft(late, tmp_path, rows, "late")
    with pytest.raises(ValueError, match="TRL's fused LM head.*enable_trl_heads"):
        enable_linear_cross_entropy(late)
    assert logged_losses(trainer) == pytest.approx(plain, rel=1e-5)  # refused: nothing was changed

    early = tiny_loss_model("llama")
    handle = enable_linear_cross_entropy(early)
    trainer = _sft(early, tmp_path, rows, "early")
    with pytest.raises(ValueError, match="fused_lm_head=True.*enable_trl_heads"):
        trainer.train()
    assert counted["linear_cross_entropy"] == 0
    handle.remove()  # unwraps from under TRL's head, which keeps working
    assert logged_losses(_sft_again(trainer)) == pytest.approx(plain, rel=1e-5)


def _sft_again(trainer):
    trainer.state.log_history.clear()
    return trainer


def test_chunked_loss_for_a_model_carrying_trl_head_is_refused(tmp_path, rows):
    model = tiny_loss_model("llama")
    _sft(model, tmp_path, rows, "head")
    with pytest.raises(ValueError, match="enable_chunked_loss: TRL's fused LM head.*enable_trl_heads"):
        enable_chunked_loss(model=model)
    assert model_patches.chunked_loss_status()[0].state != "applied"


@pytest.mark.parametrize("layout", ["padded", "packing", "padding_free"])
def test_packing_patch_under_sft_trainer_gives_trl_losses(tmp_path, layout):
    """TRL's own layouts (padded rows; packed or padding-free rows with restarting position_ids and
    no mask) train to the same losses with the packing patch on as without it."""
    pytest.importorskip("trl")
    from bench.harness.trainers import SFT_LAYOUTS, logged_losses, sft_trainer, token_rows

    rows = token_rows(12, 16, ragged=True)
    config = SFT_LAYOUTS[layout]
    plain = logged_losses(sft_trainer(tiny_loss_model("llama", attn_implementation="sdpa"), tmp_path / "plain",
                                      rows, **config))
    model = tiny_loss_model("llama", attn_implementation="sdpa")
    with model_patches.enable_packing(model=model) as handle:
        patched = logged_losses(sft_trainer(model, tmp_path / "patched", rows, **config))
        assert handle.active
    assert patched == pytest.approx(plain, rel=1e-5)


def test_chunked_loss_under_sft_trainer_is_refused_until_trl_heads_are_routed(tmp_path, rows, counted):
    from bench.harness.trainers import logged_losses

    plain = logged_losses(_sft(tiny_loss_model("llama"), tmp_path, rows, "plain"))
    with enable_chunked_loss():
        trainer = _sft(tiny_loss_model("llama"), tmp_path, rows, "chunked")
        with pytest.raises(ValueError, match="enable_chunked_loss routes.*never call.*enable_trl_heads"):
            trainer.train()
        with model_patches.enable_trl_heads():
            routed = logged_losses(_sft_again(trainer))
    assert routed == pytest.approx(plain, rel=1e-5)
    assert counted["cross_entropy"] == 0  # LOSS_MAPPING was never reached: TRL's head computed the loss


def _grpo(model, out_dir, steps: int = 2):
    import trl
    from datasets import Dataset

    from bench.harness.trainers import token_rows, word_tokenizer

    prompts = [" ".join(f"t{i}" for i in row) for row in token_rows(8, 6)]
    args = trl.GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        disable_tqdm=True, logging_steps=1, seed=0,
    )
    reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    return trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=word_tokenizer())


def test_grpo_trainer_routes_its_head_refuses_the_hidden_state_loss_and_generates_under_packing(tmp_path, rows,
                                                                                              monkeypatch):
    """GRPO generates its rollouts (under the packing patch here) and scores them with TRL's fused
    head: routed, the head runs on functional_ce with TRL's metrics and gradients."""
    from bench.harness.trainers import logged

    calls = []
    real = functional_ce.linear_token_logprobs
    monkeypatch.setattr(functional_ce, "linear_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = ("loss", "grad_norm", "entropy", "reward")
    plain = logged(_grpo(tiny_loss_model("llama"), tmp_path / "plain"), *keys)
    assert calls == []
    with model_patches.enable_packing(), model_patches.enable_trl_heads():
        routed = logged(_grpo(tiny_loss_model("llama"), tmp_path / "routed"), *keys)
    assert len(calls) >= 2 and len(routed) == len(plain) == 2
    assert routed == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in plain]

    model = tiny_loss_model("llama")
    _grpo(model, tmp_path / "refused")  # installs TRL's head
    with pytest.raises(ValueError, match="TRL's fused LM head.*enable_trl_heads"):
        enable_linear_cross_entropy(model)


def test_packing_collator_under_sft_trainer_is_refused_without_the_patch_and_trains_with_it(tmp_path, rows,
                                                                                           counted, monkeypatch):
    """``SFTTrainer(data_collator=PackingCollator(...))``: refused at the first batch without the
    packing patch; with it (and TRL's head routed) it trains on functional_ce."""
    from bench.harness.trainers import logged_losses

    calls = []
    real = functional_ce.linear_token_logprobs
    monkeypatch.setattr(functional_ce, "linear_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    collator = model_patches.PackingCollator(32)
    trainer = _sft(tiny_loss_model("llama", attn_implementation="sdpa"), tmp_path, rows, "refused")
    trainer.data_collator = collator
    with pytest.raises(ValueError, match="enable_packing"):
        trainer.train()
    model = tiny_loss_model("llama", attn_implementation="sdpa")
    with model_patches.enable_packing(model=model), model_patches.enable_trl_heads():
        trainer = _sft(model, tmp_path, rows, "packed")
        trainer.data_collator = collator
        losses = logged_losses(trainer)
    assert len(losses) == 3 and all(map(math.isfinite, losses)) and len(calls) >= 3


def _distillation(student, out_dir, steps: int = 2):
    import trl
    from datasets import Dataset

    from bench.harness.trainers import token_rows, word_tokenizer

    prompts = [" ".join(f"t{i}" for i in row) for row in token_rows(8, 6)]
    args = trl.DistillationConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4, max_completion_length=8,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )
    return trl.DistillationTrainer(model=student, teacher_model=tiny_loss_model("llama", seed=1), args=args,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                                   processing_class=word_tokenizer())


def test_distillation_trainer_routes_its_divergence_and_refuses_the_hidden_state_loss(tmp_path, rows, monkeypatch):
    """TRL's DistillationTrainer never calls the student's loss: its chunked divergence runs on
    functional_ce when routed (TRL's losses), and a hidden-state loss on the student is refused."""
    from bench.harness.trainers import logged

    calls = []
    real = functional_ce.linear_distillation_loss
    monkeypatch.setattr(functional_ce, "linear_distillation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = logged(_distillation(tiny_loss_model("llama"), tmp_path / "plain"), "loss", "grad_norm")
    assert calls == []
    with model_patches.enable_trl_heads():
        routed = logged(_distillation(tiny_loss_model("llama"), tmp_path / "routed"), "loss", "grad_norm")
    assert len(calls) >= 2 and len(routed) == len(plain) == 2
    assert routed == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in plain]

    student = tiny_loss_model("llama")
    with enable_linear_cross_entropy(student):
        with pytest.raises(ValueError, match="enable_linear_cross_entropy is active.*enable_trl_heads"):
            _distillation(student, tmp_path / "refused").train()
