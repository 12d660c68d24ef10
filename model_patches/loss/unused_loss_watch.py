"""Whether a model's training step reached this library's loss: a trainer's own head is refused,
any other bypass is reported once per model.

The loss patches (:func:`model_patches.enable_linear_cross_entropy`,
:func:`model_patches.enable_chunked_loss` with ``model=``) change what ``model(**batch,
labels=...)`` computes. Code that computes the loss some other way makes them silently unused:
TRL's trainers install their own fused LM head on the model (``add_fused_lm_head``) and call
``model(**inputs, fused_lm_head=True)``, which runs the backbone and TRL's kernel and never the
model's loss. This module

- recognises such a head on a model (:func:`trainer_fused_head`), so a patch can refuse when it
  is there already;
- watches the model's calls (:class:`LossUseWatch`, forward hooks, which run whatever
  ``forward`` is installed on top): a call asking for a trainer's fused head is refused before it
  runs, unless :func:`model_patches.enable_trl_heads` routes that head through
  ``functional_ce``; a training call with labels that ends without reaching the library's loss
  (:func:`loss_reached` not called during it) gets one warning per model.

Counting is skipped while ``torch.compile`` traces (no side effects in compiled graphs), so the
warning is an eager-mode diagnostic; the refusals hold in both.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn

from patch_layer import Handle

from .per_model_state import trl_heads_routed

__all__ = ["FUSED_HEAD_KEYWORD", "TRAINER_HEAD_FIX", "LossUseWatch", "loss_reached", "trainer_fused_head"]

logger = logging.getLogger(__name__)

#: Calls of this library's loss functions so far in this process (eager mode only).
_REACHED = [0]

#: Trainers' own fused LM heads: the qualified name of the function a trainer installs as a
#: model's instance ``forward`` -> who installs it.
FUSED_HEADS = {
    "add_fused_lm_head.<locals>._fused_forward": (
        "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head, installed by SFTTrainer, GRPOTrainer, "
        "RLOOTrainer, DPOTrainer and KTOTrainer)"
    ),
}
#: The keyword a caller passes to ask a trainer's fused head for its output.
FUSED_HEAD_KEYWORD = "fused_lm_head"
#: What to do instead when a trainer's own head computes the loss a patch of this library owns.
TRAINER_HEAD_FIX = (
    "Fix: model_patches.enable_trl_heads() routes TRL's heads through functional_ce (before or after the "
    "trainer is built), or remove this patch (handle.remove())"
)


def loss_reached() -> None:
    """Count one call of this library's loss (called by the loss patches; no-op while compiling)."""
    if not torch.compiler.is_compiling():
        _REACHED[0] += 1


def _function_of(forward: Any) -> Any:
    return getattr(forward, "__func__", forward)


def trainer_fused_head(model: nn.Module) -> Optional[str]:
    """Who installed a trainer's own fused LM head as ``model``'s forward, or None."""
    code = getattr(_function_of(model.__dict__.get("forward")), "__code__", None)
    return FUSED_HEADS.get(getattr(code, "co_qualname", ""))


class LossUseWatch(Handle):
    """Forward hooks on one model that refuse a trainer's fused-head call and report a labelled
    training call that did not reach the library's loss (once per model). ``remove()`` takes the
    hooks off. Holds no reference to the model (the model holds the hooks).

    A copy of the model (``copy.deepcopy``, pickling) carries copies of the hooks, bound to a copy of
    the watch, which stays silent unless the patch it belongs to comes with the copy and adopts it
    (:class:`~model_patches.loss.linear_cross_entropy.LinearCrossEntropyForward` does): a patch that stays
    with the original (``enable_chunked_loss(model=...)``) leaves no watch on the copy that no
    handle could remove.
    """

    def __init__(self, model: nn.Module, who: str, fix: str) -> None:
        self._name, self._who, self._fix = type(model).__name__, who, fix
        self._routed = trl_heads_routed
        self.adopted = True  # False in a copy until its patch adopts it
        self._warned = False
        self._depth = 0
        self._start = 0
        self._hooks = (
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "adopted": False}

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.adopted:
            return
        if self._depth == 0 and not torch.compiler.is_compiling():
            self._start = _REACHED[0]
        self._depth += 1  # first: the after-hook runs (always_call) even when this hook raises
        if kwargs.get(FUSED_HEAD_KEYWORD) and not self._routed():
            raise ValueError(
                f"{self._who} is active on {type(module).__name__}, but this call asks "
                f"{trainer_fused_head(module) or 'a trainer fused LM head'} for its output "
                f"({FUSED_HEAD_KEYWORD}=True): that head computes the loss from the decoder's hidden states "
                f"itself and never reaches {self._who}, which would be silently unused. {self._fix}"
            )

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if not self.adopted:
            return
        self._depth -= 1
        # output None: the call raised (this hook always runs); nothing finished without the loss
        if self._depth or self._warned or output is None or torch.compiler.is_compiling():
            return
        labelled = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if not (labelled and module.training and torch.is_grad_enabled()) or _REACHED[0] != self._start:
            return
        self._warned = True
        forward = module.__dict__.get("forward")
        by = getattr(_function_of(forward), "__qualname__", type(forward).__name__) if forward is not None else None
        msg = (
            f"{self._who}: a training call of {type(module).__name__} with labels finished without reaching "
            f"the library's loss" + (f" (its forward is now {by})" if by else "")
            + "; the loss came from other code, so the patch is unused for this model. Warned once per model."
        )
        logger.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)

    def _undo(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _describe(self) -> str:
        return f"{self._who} watch on {self._name}"
