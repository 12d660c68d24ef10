"""``nn.Module`` forms of the two losses: they hold the options, the call takes the tensors."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .linear_loss import linear_cross_entropy
from .loss import cross_entropy
from .options import ChunkOptions, ChunkSize, Reduction, check_chunk_size, check_reduction
from .shell import Count, check_compile_chunks


class _LossOptions(nn.Module):
    """Options shared by both forms, checked once at construction."""

    def __init__(
        self,
        *,
        ignore_index: int,
        reduction: Reduction,
        label_smoothing: float,
        z_loss: float,
        softcap: Optional[float],
        chunk_size: ChunkSize,
        compile_chunks: Optional[bool],
    ) -> None:
        super().__init__()
        ChunkOptions(ignore_index, label_smoothing, z_loss, softcap)  # raises on a bad option
        check_reduction(reduction, None)
        check_chunk_size(chunk_size)
        check_compile_chunks(compile_chunks)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.chunk_size = chunk_size
        self.compile_chunks = compile_chunks

    def _options(self) -> dict:
        return dict(
            ignore_index=self.ignore_index, reduction=self.reduction, label_smoothing=self.label_smoothing,
            z_loss=self.z_loss, softcap=self.softcap, chunk_size=self.chunk_size, compile_chunks=self.compile_chunks,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._options().items())


class CrossEntropyLoss(_LossOptions):
    """Module form of :func:`functional_ce.cross_entropy`, like ``nn.CrossEntropyLoss``.

    Every option is keyword-only and checked here; ``forward(logits, labels)`` takes the tensors
    (``logits [..., V]``, ``labels [...]``) and the per-batch ``mask``, ``weights`` and
    ``num_label_tokens``. Defaults are those of the function (``reduction="mean"``).

    Example::

        loss_fn = functional_ce.CrossEntropyLoss(z_loss=1e-4, inplace_grad=True)
        loss = loss_fn(logits, labels)
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        chunk_size: ChunkSize = "auto",
        inplace_grad: bool = False,
        compile_chunks: Optional[bool] = None,
    ) -> None:
        super().__init__(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, chunk_size=chunk_size, compile_chunks=compile_chunks,
        )
        if not isinstance(inplace_grad, bool):
            raise TypeError(f"inplace_grad must be a bool, got {inplace_grad!r}")
        self.inplace_grad = inplace_grad

    def _options(self) -> dict:
        return dict(super()._options(), inplace_grad=self.inplace_grad)

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        num_label_tokens: Count = None,
    ) -> torch.Tensor:
        """fp32 loss of ``logits [..., V]`` against ``labels [...]``: a scalar, or ``[...]`` for ``"none"``."""
        return cross_entropy(
            logits, labels, mask=mask, weights=weights, num_label_tokens=num_label_tokens, **self._options()
        )


class LinearCrossEntropyLoss(_LossOptions):
    """Module form of :func:`functional_ce.linear_cross_entropy`: it owns the options only.

    The LM head stays where it is (``model.lm_head``); ``forward(hidden, weight, labels,
    bias=None)`` takes ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]`` and the per-batch
    ``mask``, ``weights`` and ``num_label_tokens``, and never builds the ``[N, V]`` logits.

    Example::

        loss_fn = functional_ce.LinearCrossEntropyLoss(label_smoothing=0.1)
        loss = loss_fn(hidden, model.lm_head.weight, labels)
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        chunk_size: ChunkSize = "auto",
        compile_chunks: Optional[bool] = None,
        recompute_logits_in_backward: bool = False,
    ) -> None:
        super().__init__(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, chunk_size=chunk_size, compile_chunks=compile_chunks,
        )
        if not isinstance(recompute_logits_in_backward, bool):
            raise TypeError(f"recompute_logits_in_backward must be a bool, got {recompute_logits_in_backward!r}")
        self.recompute_logits_in_backward = recompute_logits_in_backward

    def _options(self) -> dict:
        return dict(super()._options(), recompute_logits_in_backward=self.recompute_logits_in_backward)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        mask: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        num_label_tokens: Count = None,
    ) -> torch.Tensor:
        """fp32 loss of ``hidden @ weight.T + bias`` against ``labels``: a scalar, or ``[...]`` for ``"none"``."""
        return linear_cross_entropy(
            hidden, weight, labels, bias=bias, mask=mask, weights=weights, num_label_tokens=num_label_tokens,
            **self._options(),
        )
