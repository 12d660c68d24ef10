"""The hidden-state loss with its gradients computed in forward: each chunk's logits exist once.

For a scalar loss ``sum_i coef_i * loss_i`` (``"mean"`` and ``"sum"``: ``coef_i`` is the token's
weight over the denominator, 0 on ignored rows), the gradients for a unit upstream gradient are
known in forward. ``linear_ce_fused`` computes, per chunk, the logits (one matmul), the loss and
``coef * (softmax - one_hot)`` (one compiled pass), the hidden gradient and the weight gradient
(one matmul each, the weight gradient accumulated in fp32), and keeps only those gradients and
O(N) statistics. Backward multiplies them by the upstream gradient, whatever it is: three matmuls
per chunk instead of four, and no logits recomputed. The price: ``[N, H] + [V, H] (+ [V])``
gradients are held from forward to backward (``recompute_logits_in_backward=True`` avoids it).
Rows whose label is ignored cost no matmul.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from .chunk import chunk_backward, chunk_forward
from .compiled import run_chunk
from .double_backward import refuse_double_backward
from .linear_ops import LinearGrads, ValidRows
from .options import ChunkOptions

_LIB = "functional_ce"
#: Row-indexed arguments of :func:`linear_chunk_fused`: hidden, labels, coef.
_ROWS = (0, 3, 4)


def linear_chunk_fused(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels_chunk: torch.Tensor,
    coef_chunk: torch.Tensor,
    *,
    opts: ChunkOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss rows and the gradients of ``sum(coef * loss_rows)`` of one chunk, in one graph.

    Args:
        hidden_chunk: ``[c, H]``; weight ``[V, H]`` and bias ``[V]`` (or None) of its dtype.
        labels_chunk: ``[c]`` class ids or ``opts.ignore_index``.
        coef_chunk: ``[c]`` fp32 weight of each row's loss in the scalar loss.

    Returns:
        ``(loss_rows fp32 [c], grad_hidden [c, H], grad_logits [c, V])``, gradients in the input
        dtype; the caller folds ``grad_logits`` into the weight and bias gradients.
    """
    logits = F.linear(hidden_chunk, weight, bias)
    loss, lse = chunk_forward(logits, labels_chunk, opts=opts)
    grad_logits = chunk_backward(logits, labels_chunk, lse, coef_chunk, opts=opts)
    return loss, grad_logits @ weight, grad_logits


def _linear_ce_fused_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    coef: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [N, H]``, ``weight [V, H]``, ``bias [V]?``, ``labels [N]``, ``coef [N]`` fp32 ->
    ``(loss fp32 [], loss_rows fp32 [N], grad_hidden [N, H], grad_weight [V, H], grad_bias [V])``.

    ``loss = sum(coef * loss_rows)``; the gradients are those of ``loss``, in the input dtypes,
    an empty ``[0]`` tensor where not asked for.
    """
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    rows = ValidRows.of(labels, ignore_index)
    h, y, c = rows.take(hidden), rows.take(labels), rows.take(coef)
    loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
    grads = LinearGrads(h, weight, bias, need_hidden, need_weight, need_bias, compile_chunks)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        h_c = h[start:stop]
        loss_c, grad_h_c, grad_logits = run_chunk(
            linear_chunk_fused, compile_chunks, h_c, weight, bias, y[start:stop], c[start:stop],
            row_args=_ROWS, opts=opts,
        )
        loss_rows[start:stop] = loss_c
        grads.add(start, h_c, grad_h_c, grad_logits)
        del grad_h_c, grad_logits
    return ((loss_rows * c).sum(), rows.put(loss_rows), *grads.finish(rows))


linear_ce_fused = torch.library.custom_op(f"{_LIB}::linear_ce_fused", mutates_args=())(_linear_ce_fused_impl)


@linear_ce_fused.register_fake
def _(hidden, weight, bias, labels, coef, *options_and_needs):
    need_hidden, need_weight, need_bias = options_and_needs[-3:]
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0)
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if (need_bias and bias is not None) else weight.new_empty(0)
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32), grad_h, grad_w, grad_b


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, bias, labels, coef = inputs[:5]
    need_hidden, need_weight, need_bias = inputs[-3:]
    _, loss_rows, grad_h, grad_w, grad_b = output
    ctx.needs = (need_hidden, need_weight, need_bias)
    ctx.mark_non_differentiable(loss_rows, grad_h, grad_w, grad_b)
    # no zero-filled [N, H] / [V, H] tensors for the outputs that get no gradient (a pass over
    # each, and their memory, in every backward); _backward takes a missing loss gradient as None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(loss_rows, grad_h, grad_w, grad_b, hidden, weight, bias)


def _backward(ctx: Any, grad_loss: Optional[torch.Tensor], *unused: Any) -> tuple:
    loss_rows, grad_h, grad_w, grad_b, hidden, weight, bias = ctx.saved_tensors
    no_grads = (None,) * 11
    if grad_loss is None:
        return (None,) * 5 + no_grads
    scale = grad_loss.float()
    with torch.no_grad():
        grads = tuple(
            g * scale if (need and ctx.needs_input_grad[i]) else None  # 0-dim scale: stays in g's dtype
            for i, (g, need) in enumerate(zip((grad_h, grad_w, grad_b), ctx.needs))
        )
        grad_coef = loss_rows * scale if ctx.needs_input_grad[4] else None
    grads = refuse_double_backward(
        grads, (hidden, weight, bias), "linear_cross_entropy", "F.linear + torch.nn.functional.cross_entropy"
    )
    return grads + (None, grad_coef) + no_grads


linear_ce_fused.register_autograd(_backward, setup_context=_setup_context)

#: Operator name -> its Python implementation (lets tests trace allocations inside the loop).
IMPLEMENTATIONS = {f"{_LIB}::linear_ce_fused": _linear_ce_fused_impl}
