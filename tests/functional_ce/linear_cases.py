"""Seeded inputs and fp64 references for the hidden-state loss tests."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from tests.support.reference import reference_cross_entropy


@dataclasses.dataclass
class LinearCase:
    hidden: torch.Tensor  # [*batch, H]
    weight: torch.Tensor  # [V, H]
    bias: Optional[torch.Tensor]  # [V] or None
    labels: torch.Tensor  # [*batch]
    kwargs: dict[str, Any]


def make_linear_case(
    seed: int,
    batch_shape: tuple[int, ...],
    h: int,
    v: int,
    dtype: torch.dtype,
    *,
    bias: bool = False,
    ignore_frac: float = 0.2,
    scale: float = 3.0,
    **kwargs: Any,
) -> LinearCase:
    """Hidden states and a head whose logits have standard deviation about ``scale``.

    ``mask=True`` / ``weights=True`` in ``kwargs`` become random per-token tensors.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*batch_shape, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (scale / max(h, 1) ** 0.5)).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    labels = torch.randint(0, v, batch_shape, generator=g)
    ignore = kwargs.get("ignore_index", -100)
    labels = torch.where(torch.rand(batch_shape, generator=g) < ignore_frac, ignore, labels)
    if kwargs.get("mask") is True:
        kwargs["mask"] = torch.rand(batch_shape, generator=g) < 0.8
    if kwargs.get("weights") is True:
        kwargs["weights"] = torch.rand(batch_shape, generator=g) * 2
    return LinearCase(hidden, weight, b, labels, kwargs)


def reference_linear(hidden, weight, labels, *, bias=None, dtype=torch.float64, **kwargs) -> torch.Tensor:
    """``reference_cross_entropy(hidden @ weight.T + bias)``, the logits computed in ``dtype``.

    ``dtype=None`` keeps the inputs' own dtype for the projection (what a user's naive
    ``F.linear`` in bf16 does) and evaluates the loss in fp32.
    """
    if dtype is None:
        logits = F.linear(hidden, weight, bias)
        return reference_cross_entropy(logits, labels, dtype=torch.float32, **kwargs)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return reference_cross_entropy(logits, labels, dtype=dtype, **kwargs)


def linear_loss_and_grads(
    fn: Callable[..., torch.Tensor], case: LinearCase, upstream_seed: int = 1, **extra: Any
) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Run ``fn(hidden, weight, labels, bias=..., **kwargs)`` and backward with a seeded upstream.

    Returns the detached output and the gradients of hidden, weight and bias (None without bias).
    """
    leaves = [case.hidden.detach().clone().requires_grad_(), case.weight.detach().clone().requires_grad_()]
    if case.bias is not None:
        leaves.append(case.bias.detach().clone().requires_grad_())
    bias = leaves[2] if case.bias is not None else None
    out = fn(leaves[0], leaves[1], case.labels, bias=bias, **case.kwargs, **extra)
    up = torch.rand(out.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    grads = torch.autograd.grad((out * up.to(out.dtype)).sum(), leaves)
    return out.detach(), list(grads) + ([None] if case.bias is None else [])
