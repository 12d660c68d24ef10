"""What the chunk maths of every loss shares: the logits a loss sees, their gradient's chain rule,
the target logit and the label columns."""

from __future__ import annotations

from typing import Optional

import torch

from ..spec import LossSpec


def _caps(spec: LossSpec, teacher: bool) -> tuple[float, Optional[float]]:
    """``(logit_scale, softcap)`` of the student's (or the first input's) or the teacher's logits."""
    if teacher:
        return spec.teacher_logit_scale, spec.teacher_softcap
    return spec.logit_scale, spec.softcap


def scaled(z: torch.Tensor, spec: LossSpec, *, teacher: bool = False) -> torch.Tensor:
    """The logits the loss sees, in fp32: times ``spec.logit_scale``, soft-capped when
    ``spec.softcap``, then divided by ``spec.temperature`` (``teacher``: the teacher's scale and
    soft-cap, the same temperature)."""
    scale, cap = _caps(spec, teacher)
    x = z.float()
    if scale != 1.0:
        x = x * scale
    if cap is not None:
        x = torch.tanh(x / cap) * cap
    return x if spec.temperature == 1.0 else x / spec.temperature


def chain(grad: torch.Tensor, z: torch.Tensor, spec: LossSpec, *, teacher: bool = False) -> torch.Tensor:
    """``grad`` w.r.t. :func:`scaled` ``(z)`` turned into the gradient w.r.t. ``z`` (fp32)."""
    scale, cap = _caps(spec, teacher)
    if cap is not None:
        y = z.float() if scale == 1.0 else z.float() * scale
        t = torch.tanh(y / cap)
        grad = grad * (1.0 - t * t)
    if spec.temperature != 1.0:
        grad = grad / spec.temperature
    return grad if scale == 1.0 else grad * scale


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
