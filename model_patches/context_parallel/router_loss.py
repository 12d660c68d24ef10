"""The MoE load-balancing loss of a context-parallel forward, over the whole sequence.

Transformers' ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``
averages the routers' top-k assignments and probabilities over every token of the batch; on a
context-parallel process it would see only its shard (and the shard's padding). While a model
enabled with :func:`~.enable.enable_context_parallel` runs its forward, the packing patch's
replacement of that function (:mod:`model_patches.packing.aux_loss`) hands it instead:

- every layer's router logits all-gathered over the group (``[world x local tokens, experts]``,
  rank-major; backward sums their gradients over the group and keeps this process's rows), and
- a validity mask of the same tokens: 1 for real tokens, 0 for the shard's padding (negative
  document ids, :func:`~.enable.shard_batch`).

The loss is a mean over tokens, so the gathered order does not matter: every process computes the
whole sequence's loss and returns its ``1 / world`` share, so that the group's losses sum to the
one process's, and so do the router gradients.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .attention import CPGroup, gather_sequence, gather_tokens

__all__ = ["active_forward", "forward_hooks", "sequence_load_balancing_loss"]

_STATE = threading.local()


def _stack() -> list[tuple[CPGroup, torch.Tensor]]:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack


def active_forward() -> Optional[tuple[CPGroup, torch.Tensor]]:
    """``(group, validity [B, L])`` of the context-parallel forward running in this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def forward_hooks(model: torch.nn.Module, cp: CPGroup, documents_key: str,
                  check: Callable[[dict[str, Any]], None]) -> list[Any]:
    """Hooks that mark ``model``'s forward as context-parallel while it runs (its validity: tokens
    whose ``documents_key`` id is not negative); ``check(kwargs)`` runs first. Returns the hook
    handles (``.remove()`` each)."""

    def enter(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        check(kwargs)
        documents = kwargs.get(documents_key)
        if documents is not None:
            _stack().append((cp, documents >= 0))

    def leave(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if kwargs.get(documents_key) is not None and _stack():
            _stack().pop()

    return [model.register_forward_pre_hook(enter, with_kwargs=True),
            model.register_forward_hook(leave, with_kwargs=True, always_call=True)]


def sequence_load_balancing_loss(original: Callable, params: Sequence[str], args: tuple, kwargs: dict[str, Any],
                                 active: tuple[CPGroup, torch.Tensor]) -> Any:
    """``original``'s loss over every process's tokens (see the module docstring), this process's
    ``1 / world`` share. ``params``: ``original``'s parameter names; its first takes the gate logits."""
    from ..arguments import argument, with_arguments

    cp, valid = active
    gates = argument(args, kwargs, params, params[0])
    if not isinstance(gates, tuple) or not gates:
        return original(*args, **kwargs)
    gathered = tuple(gather_sequence(g, cp, 0) for g in gates)
    mask = gather_tokens(valid.to(torch.long), cp, dim=0)  # [world * B, L], the gathered rows' order
    args, kwargs = with_arguments(args, kwargs, params, **{params[0]: gathered, "attention_mask": mask})
    return original(*args, **kwargs) / cp.world
