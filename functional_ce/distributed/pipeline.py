"""A pipeline schedule's ``loss_fn`` for a last stage that emits hidden states.

``torch.distributed.pipelining`` calls ``loss_fn(output, target)`` on the last stage's output. To
use :func:`functional_ce.linear_cross_entropy` there, the last stage emits hidden states and the
loss applies the LM head. The head must still be a parameter of the last stage's module (held
there, not called in its forward): the schedule then scales its gradient with the stage's other
parameters (``scale_grads=True``) and data-parallel wrappers reduce it with them. The loss
honours whatever gradient flows into it (a scaled loss, a loss used twice), so dividing the loss
yourself works too.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from ..loss import linear_cross_entropy
from ..spec import check_keywords


def pipeline_loss_fn(head: nn.Linear, **options: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(hidden, target) = linear_cross_entropy(hidden, head.weight, target, bias=head.bias, **options)``.

    Args:
        head: the LM head, an ``nn.Linear`` ``[V, H]`` registered in the last stage's module.
        **options: keyword options of :func:`functional_ce.linear_cross_entropy` (``reduction``,
            ``num_label_tokens``, ``label_smoothing``, ...).

    Returns:
        A function of the stage output ``[..., H]`` and the target ``[...]`` returning the loss.

    Raises:
        TypeError: ``head`` is not an ``nn.Linear``.
    """
    if not isinstance(head, nn.Linear):
        raise TypeError(f"head must be the LM head nn.Linear, got {type(head).__name__}")
    check_keywords("linear", options)

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, head.weight, target, bias=head.bias, **options)

    return loss_fn


def hidden_state_loss_fn(lm_head: nn.Module, **options: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Deprecated: the former name of :func:`pipeline_loss_fn`, kept for one release; warns with a
    ``DeprecationWarning`` and returns ``pipeline_loss_fn(lm_head, **options)``."""
    warnings.warn("functional_ce.hidden_state_loss_fn is deprecated and will be removed in the next minor "
                  "release; use functional_ce.pipeline_loss_fn", DeprecationWarning, stacklevel=2)
    return pipeline_loss_fn(lm_head, **options)
