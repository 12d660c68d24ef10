"""What the chunk maths of every loss shares: the logits a loss sees, their gradient's chain rule,
the target logit and the label columns."""

from __future__ import annotations

import torch

from ..spec import LossSpec


def scaled(z: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """The logits the loss sees, in fp32: times ``spec.logit_scale``, soft-capped when
    ``spec.softcap``, then divided by ``spec.temperature``."""
    x = z.float()
    if spec.logit_scale != 1.0:
        x = x * spec.logit_scale
    if spec.softcap is not None:
        x = torch.tanh(x / spec.softcap) * spec.softcap
    return x if spec.temperature == 1.0 else x / spec.temperature


def chain(grad: torch.Tensor, z: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``grad`` w.r.t. :func:`scaled` ``(z)`` turned into the gradient w.r.t. ``z`` (fp32)."""
    if spec.softcap is not None:
        y = z.float() if spec.logit_scale == 1.0 else z.float() * spec.logit_scale
        t = torch.tanh(y / spec.softcap)
        grad = grad * (1.0 - t * t)
    if spec.temperature != 1.0:
        grad = grad / spec.temperature
    return grad if spec.logit_scale == 1.0 else grad * spec.logit_scale


def target_logit(x: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target logit [c], in_slice [c])``: each row's logit of its label where the label lies in
    this slice (columns from ``spec.vocab_start`` on) and is not ignored, else 0."""
    local = labels.long() - spec.vocab_start
    here = (labels != spec.ignore_index) & (local >= 0) & (local < x.shape[-1])
    target = x.gather(-1, torch.where(here, local, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(here, target, 0.0), here


def label_hit(x: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``[c, V_slice]`` bool: where a column is the row's label."""
    safe = torch.where(labels != spec.ignore_index, labels, 0)
    # int32 class ids (vocabularies are < 2**31): the [c, V] comparison vectorises twice as wide
    # as in int64 (10% of the compiled chunk on CPU)
    cols = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32) + spec.vocab_start
    return cols.unsqueeze(0) == safe.int().unsqueeze(-1)


def where_p(p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``p * d`` with 0 where ``p`` is 0 (the limit, where ``d`` may be infinite)."""
    return torch.where(p > 0, p * d, 0.0)


def counted(labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    return labels != spec.ignore_index
