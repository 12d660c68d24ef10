"""``nn.Module`` forms of the two losses: they hold the options, the call takes the tensors."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .loss import cross_entropy, linear_cross_entropy
from .spec import Count, check_keywords, keyword_signature


class _HeldOptions(nn.Module):
    """The keyword options of the loss form ``_FORM`` except the per-batch ones, checked at
    construction and held as attributes (``loss_fn.z_loss``), which each call reads."""

    _FORM = "logits"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        held = check_keywords(self._FORM, options, batch=False)
        self._option_names = tuple(held)
        for name, value in held.items():
            setattr(self, name, value)

    @property
    def _options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._options.items())


class CrossEntropyLoss(_HeldOptions):
    """Module form of :func:`functional_ce.cross_entropy`, like ``nn.CrossEntropyLoss``.

    Every option is keyword-only and checked here; ``forward(logits, labels)`` takes the tensors
    (``logits [..., V]``, ``labels [...]``) and the per-batch ``mask``, ``weights`` and
    ``num_label_tokens``. Defaults are those of the function (``reduction="mean"``).

    Example::

        loss_fn = functional_ce.CrossEntropyLoss(z_loss=1e-4, inplace_grad=True)
        loss = loss_fn(logits, labels)
    """

    _FORM = "logits"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, *, mask: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None, num_label_tokens: Count = None) -> torch.Tensor:
        """fp32 loss of ``logits [..., V]`` against ``labels [...]``: a scalar, or ``[...]`` for ``"none"``."""
        return cross_entropy(logits, labels, mask=mask, weights=weights, num_label_tokens=num_label_tokens,
                             **self._options)


class LinearCrossEntropyLoss(_HeldOptions):
    """Module form of :func:`functional_ce.linear_cross_entropy`: it owns the options only.

    The LM head stays where it is (``model.lm_head``); ``forward(hidden, weight, labels,
    bias=None)`` takes ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]`` and the per-batch
    ``mask``, ``weights`` and ``num_label_tokens``, and never builds the ``[N, V]`` logits.

    Example::

        loss_fn = functional_ce.LinearCrossEntropyLoss(label_smoothing=0.1)
        loss = loss_fn(hidden, model.lm_head.weight, labels)
    """

    _FORM = "linear"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: Optional[torch.Tensor] = None, *, mask: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None, num_label_tokens: Count = None) -> torch.Tensor:
        """fp32 loss of ``hidden @ weight.T + bias`` against ``labels``: a scalar, or ``[...]`` for ``"none"``."""
        return linear_cross_entropy(hidden, weight, labels, bias=bias, mask=mask, weights=weights,
                                    num_label_tokens=num_label_tokens, **self._options)


keyword_signature(CrossEntropyLoss.__init__, "logits", batch=False)
keyword_signature(LinearCrossEntropyLoss.__init__, "linear", batch=False)
