"""MoE router load-balancing losses under packing: every real token counts once.

Transformers' ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``
(Switch-Transformer auxiliary loss, in each MoE model module) weights each token by its
``attention_mask`` value. With an indexed mask (``1, 1, 2, 2, 3, 0``) document k would count k
times, skewing the aux loss and the router gradients. The replacement hands the original a 0/1
validity mask (``mask != 0``, in the mask's dtype) whenever the mask reads as document ids;
bool masks and ``None`` pass through. No host sync, so it compiles without a break.

Inside the forward of a model enabled with ``enable_context_parallel``, the loss is the whole
sequence's, from every process's router logits
(:func:`model_patches.context_parallel.router_loss.sequence_load_balancing_loss`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from ..arguments import argument, with_arguments
from ..context_parallel.router_loss import active_forward, sequence_load_balancing_loss
from ..targets import parameters, parameters_probe
from .masks import reads_as_document_ids

__all__ = ["AUX_LOSS_NAME", "aux_loss_probe", "build_aux_loss"]

#: The module-level function each MoE model module calls from its ``ForCausalLM.forward``.
AUX_LOSS_NAME = "load_balancing_loss_func"


def aux_loss_probe(fn: Any) -> Optional[str]:
    """The function must take ``attention_mask`` (by name or as its fourth parameter)."""
    return parameters_probe(fn, required=("attention_mask",))


def build_aux_loss(original: Callable) -> Callable:
    """``load_balancing_loss_func`` that sees a 0/1 validity mask instead of document ids."""
    params = parameters(original)

    @functools.wraps(original)
    def load_balancing_loss(*args: Any, **kwargs: Any) -> Any:
        active = active_forward()
        if active is not None:
            return sequence_load_balancing_loss(original, params, args, kwargs, active)
        mask = argument(args, kwargs, params, "attention_mask")
        if reads_as_document_ids(mask):
            args, kwargs = with_arguments(args, kwargs, params, attention_mask=(mask != 0).to(mask.dtype))
        return original(*args, **kwargs)

    load_balancing_loss._packing_original = original  # type: ignore[attr-defined]
    return load_balancing_loss
