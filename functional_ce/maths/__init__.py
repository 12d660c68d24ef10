"""The chunk maths of each loss over the vocabulary, and the table of them.

A loss is a :class:`LossMaths`: pure functions of one chunk of rows (``zs``: the chunk's logits of
each input, ``[c, V_slice]`` in the input dtype, the columns from ``spec.vocab_start`` on):

- ``passes``: the per-row statistics, pass by pass, ``(zs, labels, prior, spec) -> [c, k]`` fp32,
  ``prior`` the previous passes' full-vocabulary statistics (None for the first). Column ``i`` of
  a pass has the kind ``kinds(spec)[pass][i]`` that says how vocabulary slices combine: ``"lse"``
  (a logsumexp, combined by a logsumexp), ``"sum"`` (summed), ``"max"`` (a maximum, -inf over
  no class) or ``"mean@j"`` (a mean under the slice's softmax of the pass's ``"lse"`` column
  ``j``, combined weighted by each slice's mass).
  A second pass is for statistics that need the first pass's full-vocabulary values.
- ``rows(stats, labels, spec) -> (rows [c] or [c, m], saved [c, j])``: each row's output from the
  full-vocabulary statistics, and the fp32 values its gradient needs.
- ``grad(zs, labels, saved, grad_rows, spec) -> (grad z, ...)``: the gradient of
  ``sum(grad_rows * rows)`` with respect to each input's chunk (None where not needed).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from ..spec import LossSpec
from .cross_entropy import ce_grad, ce_rows, ce_stats
from .distillation import kd_divergence, kd_grad, kd_lse, kd_rows
from .token_logprobs import logp_grad, logp_kinds, logp_rows, logp_stats


@dataclasses.dataclass(frozen=True)
class LossMaths:
    """The pure chunk functions of one loss (see the module docstring)."""

    #: The statistics, pass by pass: ``(zs, labels, prior, spec) -> [c, k]``.
    passes: tuple[Callable[..., torch.Tensor], ...]
    #: Per pass, the kind of each column: ``"lse"``, ``"sum"``, ``"max"``, ``"mean@i"``.
    kinds: Callable[[LossSpec], tuple[tuple[str, ...], ...]]
    rows: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad: Callable[..., tuple[Optional[torch.Tensor], ...]]
    #: ``(public name, what to use for double backward)`` of the logits and the hidden-state form.
    names: tuple[tuple[str, str], tuple[str, str]]

    def width(self, spec: LossSpec) -> int:
        """Columns of the statistics: of pass ``spec.stats_pass``, or of all of them (-1)."""
        kinds = self.kinds(spec)
        return sum(map(len, kinds)) if spec.stats_pass < 0 else len(kinds[spec.stats_pass])

    def stats(self, zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor],
              spec: LossSpec) -> torch.Tensor:
        """Pass ``spec.stats_pass`` given the previous passes' full statistics ``prior``, or (-1)
        every pass on a chunk that holds the whole vocabulary, each the next one's ``prior``."""
        if spec.stats_pass >= 0:
            return self.passes[spec.stats_pass](zs, labels, prior, spec)
        done: Optional[torch.Tensor] = None
        for fn in self.passes:
            part = fn(zs, labels, done, spec)
            done = part if done is None else torch.cat([done, part], dim=-1)
        return done


_TORCH = "torch.nn.functional"
#: ``LossSpec.loss`` -> its maths.
LOSSES = {
    "cross_entropy": LossMaths(
        (ce_stats,), lambda spec: (("lse", "sum", "sum")[:3 if spec.label_smoothing > 0.0 else 2],),
        ce_rows, ce_grad,
        (("cross_entropy", f"{_TORCH}.cross_entropy"), ("linear_cross_entropy", f"F.linear + {_TORCH}.cross_entropy")),
    ),
    "token_logprobs": LossMaths(
        (logp_stats,), logp_kinds,
        logp_rows, logp_grad,
        (("token_logprobs", f"{_TORCH}.log_softmax"), ("linear_token_logprobs", f"F.linear + {_TORCH}.log_softmax")),
    ),
    "distillation": LossMaths(
        (kd_lse, kd_divergence), lambda spec: (("lse", "lse"), ("sum",) * (1 if spec.beta in (0.0, 1.0) else 2)),
        kd_rows, kd_grad,
        (("distillation_loss", f"{_TORCH}.log_softmax + {_TORCH}.kl_div"),
         ("linear_distillation_loss", f"F.linear + {_TORCH}.log_softmax + {_TORCH}.kl_div")),
    ),
}
