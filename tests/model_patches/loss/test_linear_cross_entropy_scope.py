"""A loss patch concerns only the model it is on: TRL's unrouted kernels are refused for that
model, never for another, and a model that is gone takes its patch's global state with it.

The user story: a refused ``SFTTrainer`` run on model A with a loss patch, the handle never
removed, then a plain ``SFTTrainer`` run of another model B in the same process. B must train
exactly as stock TRL does (same losses as a stock run of the same B), whether A and its handle
were dropped and collected or are still alive. The same for ``enable_linear_cross_entropy(model)``
and ``enable_chunked_loss(model=...)``; ``enable_chunked_loss()`` without a model is
process-wide and refuses every TRL run while its handle is active (tested in
test_loss_in_trainers.py).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

trl = pytest.importorskip("trl")

import trl.trainer.distillation_trainer as distillation_module  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402

import model_patches  # noqa: E402
from bench.harness.trainers import logged_losses, sft_trainer, token_rows  # noqa: E402
from model_patches import enable_chunked_loss, enable_linear_cross_entropy  # noqa: E402
from tests.support.tiny_models import tiny_loss_model  # noqa: E402

TRL_HEAD = trl_utils._ChunkedLogProbFunction
TRL_DIVERGENCE = distillation_module._chunked_divergence_loss

#: The per-model loss patches: name -> enable on a model (returns the handle).
PATCHES = {
    "hidden_state_loss": lambda model: enable_linear_cross_entropy(model),
    "chunked_loss": lambda model: enable_chunked_loss(model=model),
}
#: What the refused run of model A says, per patch.
REFUSALS = {
    "hidden_state_loss": "enable_linear_cross_entropy is active on LlamaForCausalLM.*enable_trl_heads",
    "chunked_loss": "enable_chunked_loss is active on LlamaForCausalLM.*enable_trl_heads",
}


@pytest.fixture(scope="module")
def rows():
    return token_rows(12, 16)


@pytest.fixture(scope="module")
def stock(rows, tmp_path_factory):
    """The losses of a stock TRL run of model B (seed 1), before any patch exists."""
    return logged_losses(sft_trainer(tiny_loss_model("llama", seed=1), tmp_path_factory.mktemp("stock"), rows,
                                     steps=2))


def _model_b_losses(tmp_path, rows):
    return logged_losses(sft_trainer(tiny_loss_model("llama", seed=1), tmp_path / "b", rows, steps=2))


def _refused_run(patch, tmp_path, rows):
    """Model A with ``patch``, an ``SFTTrainer`` on it, its run refused: (A, handle, trainer)."""
    model = tiny_loss_model("llama")
    handle = PATCHES[patch](model)
    trainer = sft_trainer(model, tmp_path / "a", rows, steps=2)
    with pytest.raises(ValueError, match=REFUSALS[patch]):
        trainer.train()
    return model, handle, trainer


def _stock_trl_objects() -> bool:
    head, divergence = trl_utils._ChunkedLogProbFunction, distillation_module._chunked_divergence_loss
    return head is TRL_HEAD and divergence is TRL_DIVERGENCE


@pytest.mark.parametrize("patch", PATCHES)
def test_a_refused_run_with_its_handle_dropped_leaves_stock_trl_training_for_another_model(patch, tmp_path, rows,
                                                                                          stock):
    model, handle, trainer = _refused_run(patch, tmp_path, rows)
    gone = weakref.ref(model)
    del model, handle, trainer
    gc.collect()
    assert gone() is None, "the handle (or its global state) keeps the patched model alive"
    assert _stock_trl_objects()  # the refusal's patches of TRL's kernels were released with the model
    assert model_patches.chunked_loss_status()[0].state != "applied"
    assert _model_b_losses(tmp_path, rows) == stock


@pytest.mark.parametrize("patch", PATCHES)
def test_while_a_patched_model_lives_another_model_trains_with_stock_trl(patch, tmp_path, rows, stock):
    model, handle, trainer = _refused_run(patch, tmp_path, rows)
    try:
        assert _model_b_losses(tmp_path, rows) == stock
        with pytest.raises(ValueError, match=REFUSALS[patch]):
            trainer.train()  # still refused for the model the patch is on
        assert handle.active
    finally:
        handle.remove()
    assert _stock_trl_objects()


@pytest.mark.parametrize("patch", PATCHES)
def test_a_kept_handle_does_not_keep_its_model_alive_and_is_released_with_it(patch):
    model = tiny_loss_model("llama")
    handle = PATCHES[patch](model)
    assert not _stock_trl_objects() and handle.active
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    assert not handle.active and "removed" in repr(handle)
    assert _stock_trl_objects()
    assert model_patches.chunked_loss_status()[0].state != "applied"
    handle.remove()  # a no-op now


def _divergence_inputs(student_weight):
    g = torch.Generator().manual_seed(0)
    v, h = student_weight.shape
    return dict(
        student_hidden_states=torch.randn(2, 5, h, generator=g),
        teacher_hidden_states=torch.randn(2, 5, h, generator=g),
        student_lm_head_weight=student_weight, teacher_lm_head_weight=torch.randn(v, h, generator=g),
        completion_mask=torch.ones(2, 5, dtype=torch.long), beta=0.5,
    )


@pytest.mark.parametrize("patch", PATCHES)
def test_trls_kernels_are_refused_only_for_the_patched_models_head(patch):
    """Kernel calls outside any model call: refused when they compute with the patched model's
    LM head (DistillationTrainer's student), TRL's own for any other weight."""
    model = tiny_loss_model("llama")
    other = tiny_loss_model("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    hidden, targets = torch.randn(6, 64, generator=g), torch.randint(0, 300, (6,), generator=g)
    with PATCHES[patch](model):
        for weight in (model.lm_head.weight, other.lm_head.weight):
            refused = weight is model.lm_head.weight
            for call in (lambda: trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 64),
                         lambda: distillation_module._chunked_divergence_loss(**_divergence_inputs(weight))):
                if refused:
                    with pytest.raises(ValueError, match="is active on LlamaForCausalLM.*enable_trl_heads"):
                        call()
                else:
                    call()
        with model_patches.enable_trl_heads():  # routed: computed for every model
            trl_utils._ChunkedLogProbFunction.apply(hidden, model.lm_head.weight, None, targets, 1.0, 64)
        status = model_patches.trl_heads_status()[0].reason
        assert "refusing for LlamaForCausalLM" in status


def test_a_process_wide_chunked_loss_refuses_trls_kernels_for_every_model():
    hidden, weight = torch.randn(6, 64), torch.randn(300, 64)
    with enable_chunked_loss():
        with pytest.raises(ValueError, match="enable_chunked_loss routes.*every model"):
            trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, torch.zeros(6, dtype=torch.long), 1.0, 64)
    trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, torch.zeros(6, dtype=torch.long), 1.0, 64)
