"""Seeded inputs for the cross-entropy tests: hypothesis draws sizes and options, not tensors."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Worst-case absolute error of one rounding of a value of magnitude ~1, per dtype.
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}

#: The two ways an eager call runs the chunk maths: inductor-compiled chunk graphs (what users
#: get by default) and the eager functions. Tests take ``compile_chunks=PATHS[path]``.
PATHS = {"compiled": True, "eager": False}

#: A compiled chunk graph specialises on the vocabulary, the dtype and the options, and each
#: first compile costs seconds on a CPU. Property tests of the compiled path therefore draw
#: from this vocabulary and these option sets only (every option is on in the second), and
#: vary everything the graphs are generic over: token shapes, chunk sizes, labels, masks,
#: weights, reductions.
COMPILED_V = 67
COMPILED_OPTIONS = ({}, {"ignore_index": 3, "label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0})


@dataclasses.dataclass
class Case:
    logits: torch.Tensor  # leaf, requires grad
    labels: torch.Tensor
    kwargs: dict[str, Any]


def make_case(
    seed: int,
    batch_shape: tuple[int, ...],
    v: int,
    dtype: torch.dtype,
    *,
    ignore_frac: float = 0.2,
    label_dtype: torch.dtype = torch.int64,
    transposed: bool = False,
    scale: float = 3.0,
    **kwargs: Any,
) -> Case:
    """Random logits ``[*batch_shape, V]`` and labels; ``kwargs`` are loss options.

    ``mask=True`` / ``weights=True`` in ``kwargs`` are replaced by random tensors of the batch
    shape. ``transposed`` gives logits with non-unit last-dim stride.
    """
    g = torch.Generator().manual_seed(seed)
    if transposed:
        base = torch.randn(v, *batch_shape, generator=g) * scale
        logits = base.movedim(0, -1).to(dtype)
        logits = logits.detach().movedim(-1, 0).contiguous().movedim(0, -1)
    else:
        logits = (torch.randn(*batch_shape, v, generator=g) * scale).to(dtype)
    labels = torch.randint(0, v, batch_shape, generator=g)
    ignore = kwargs.get("ignore_index", -100)
    labels = torch.where(torch.rand(batch_shape, generator=g) < ignore_frac, ignore, labels).to(label_dtype)
    if kwargs.get("mask") is True:
        kwargs["mask"] = torch.rand(batch_shape, generator=g) < 0.8
    if kwargs.get("weights") is True:
        kwargs["weights"] = torch.rand(batch_shape, generator=g) * 2
    return Case(logits.requires_grad_(), labels, kwargs)


def loss_and_grad(fn, case: Case, upstream_seed: int = 1, **extra: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``fn(logits, labels, **kwargs)`` and backward with a seeded upstream gradient."""
    logits = case.logits.detach().clone().requires_grad_()
    out = fn(logits, case.labels, **case.kwargs, **extra)
    up = torch.rand(out.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    (out * up.to(out.dtype)).sum().backward()
    return out.detach(), logits.grad


def absmax(t: torch.Tensor) -> float:
    """Largest finite magnitude of ``t`` (0 when there is none)."""
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


def worst(excess: torch.Tensor) -> float:
    """Largest excess over the tolerance; nan (a nan where the reference is not) counts as failure."""
    if excess.numel() == 0:
        return float("-inf")
    return float("inf") if bool(excess.isnan().any()) else excess.max().item()
