"""Custom operators of the vocabulary-parallel losses: each process works on its slice of the
vocabulary, chunk by chunk, and never communicates.

A loss over a sharded vocabulary is computed in three steps (:mod:`functional_ce.vocab_parallel`
drives them):

1. a *stats* operator reads the local logits (or builds them chunk by chunk from hidden states)
   and returns, per row, the slice's logsumexp, the target logit if the target is in the slice
   (else 0), and the sum of the slice's logits: ``[3, N]`` fp32, no autograd;
2. O(N) collectives combine them into the full-vocabulary ``logsumexp``, target logit and logit
   sum (in traceable Python, outside these operators);
3. a *rows* operator turns the combined statistics into per-row losses (O(N) elementwise work)
   and carries the autograd formula: its backward recomputes the softmax of the local slice from
   the global ``logsumexp``, so the gradient of the local logits, weight slice and (partial)
   hidden states needs no communication.

Rows whose label is ignored cost no matmul in the hidden-state operators.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .compiled import run_chunk, stats_into
from .linear_chunk import linear_chunk_stats
from .linear_ops import ValidRows, recomputed_gradients
from .ops import logits_gradient
from .options import ChunkOptions

_LIB = "functional_ce"


def rows_from_stats(
    lse: torch.Tensor, target: torch.Tensor, total: torch.Tensor, labels: torch.Tensor, opts: ChunkOptions
) -> torch.Tensor:
    """Per-row loss ``[N]`` fp32 from the full-vocabulary statistics (each ``[N]`` fp32): the
    formula of :func:`~functional_ce.chunk.chunk_forward`, with ``total / opts.n_classes`` as the
    mean logit. 0 on ignored rows."""
    loss = lse - target
    if opts.label_smoothing > 0.0:
        eps = opts.label_smoothing
        loss = (1.0 - eps) * loss + eps * (lse - total / opts.n_classes)
    if opts.z_loss > 0.0:
        loss = loss + opts.z_loss * lse * lse
    return torch.where(labels != opts.ignore_index, loss, 0.0)


def _empty_slice_stats(n: int, device: torch.device) -> torch.Tensor:
    """The statistics of a slice with no class: logsumexp -inf, target 0, sum 0."""
    stats = torch.zeros(3, n, dtype=torch.float32, device=device)
    stats[0] = -torch.inf
    return stats


# --- the logits form ---------------------------------------------------------------------------


def _vocab_slice_stats_impl(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
) -> torch.Tensor:
    """``logits [N, V_local]`` (classes from ``vocab_start`` on), ``labels [N]`` global ids ->
    ``[3, N]`` fp32: the slice's logsumexp, target logit (0 if elsewhere) and logit sum per row."""
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    n = logits.shape[0]
    if logits.shape[1] == 0:
        return _empty_slice_stats(n, logits.device)
    stats = torch.empty(3, n, dtype=torch.float32, device=logits.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        run_chunk(stats_into, compile_chunks, stats[0, rows], stats[1, rows], stats[2, rows], logits[rows],
                  labels[rows], row_args=(0, 1, 2, 3, 4), opts=opts)
    return stats


vocab_slice_stats = torch.library.custom_op(f"{_LIB}::vocab_slice_stats", mutates_args=())(
    _vocab_slice_stats_impl
)


@vocab_slice_stats.register_fake
def _(logits, labels, *options):
    return logits.new_empty((3, logits.shape[0]), dtype=torch.float32)


def _vocab_slice_rows_impl(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    total: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
    inplace_grad: bool,
) -> torch.Tensor:
    """Per-row loss ``[N]`` fp32 from the combined statistics; differentiable in ``logits``
    (the local slice ``[N, V_local]``). ``inplace_grad`` only says where backward writes."""
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    return rows_from_stats(lse, target, total, labels, opts)


vocab_slice_rows = torch.library.custom_op(f"{_LIB}::vocab_slice_rows", mutates_args=())(_vocab_slice_rows_impl)


@vocab_slice_rows.register_fake
def _(logits, labels, lse, target, total, *options):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _setup_slice_rows(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    logits, labels, lse = inputs[:3]
    *options, ctx.chunk_size, ctx.compile_chunks, ctx.inplace_grad = inputs[5:]
    ctx.opts = ChunkOptions(*options)
    ctx.save_for_backward(logits, labels, lse)


def _backward_slice_rows(ctx: Any, grad_rows: Optional[torch.Tensor]) -> tuple:
    logits, labels, lse = ctx.saved_tensors
    no_grads = (None,) * 13
    if grad_rows is None or not ctx.needs_input_grad[0]:
        return (None,) + no_grads
    grad = logits_gradient(grad_rows, logits, labels, lse, ctx.opts, ctx.chunk_size, ctx.compile_chunks,
                           ctx.inplace_grad)
    return (grad,) + no_grads


vocab_slice_rows.register_autograd(_backward_slice_rows, setup_context=_setup_slice_rows)


# --- the hidden-state form ---------------------------------------------------------------------


def _linear_slice_stats_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
) -> torch.Tensor:
    """``hidden [N, H]``, ``weight [V_local, H]``, ``bias [V_local]?``, ``labels [N]`` -> ``[3, N]``
    fp32 slice statistics (see :func:`_vocab_slice_stats_impl`) of the logits ``hidden @ weight.T
    + bias``, built one chunk at a time. Ignored rows take part in no matmul (statistics 0)."""
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    n = hidden.shape[0]
    if weight.shape[0] == 0:
        return _empty_slice_stats(n, hidden.device)
    rows = ValidRows.of(labels, ignore_index)
    h, y = rows.take(hidden), rows.take(labels)
    stats = torch.empty(3, h.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        chunk = run_chunk(linear_chunk_stats, compile_chunks, h[start:stop], weight, bias, y[start:stop],
                          row_args=(0, 3), opts=opts)
        for i, part in enumerate(chunk):
            stats[i, start:stop] = part
    return rows.put(stats.t()).t().contiguous()


linear_slice_stats = torch.library.custom_op(f"{_LIB}::linear_slice_stats", mutates_args=())(
    _linear_slice_stats_impl
)


@linear_slice_stats.register_fake
def _(hidden, weight, bias, labels, *options):
    return hidden.new_empty((3, hidden.shape[0]), dtype=torch.float32)


def _linear_slice_rows_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    total: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
) -> torch.Tensor:
    """Per-row loss ``[N]`` fp32 from the combined statistics; differentiable in ``hidden``,
    ``weight`` and ``bias`` (backward recomputes each chunk's local logits)."""
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    return rows_from_stats(lse, target, total, labels, opts)


linear_slice_rows = torch.library.custom_op(f"{_LIB}::linear_slice_rows", mutates_args=())(_linear_slice_rows_impl)


@linear_slice_rows.register_fake
def _(hidden, weight, bias, labels, lse, target, total, *options):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _setup_linear_rows(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    hidden, weight, bias, labels, lse = inputs[:5]
    *options, ctx.chunk_size, ctx.compile_chunks = inputs[7:]
    ctx.opts = ChunkOptions(*options)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, lse)


def _backward_linear_rows(ctx: Any, grad_rows: Optional[torch.Tensor]) -> tuple:
    return recomputed_gradients(ctx, grad_rows) + (None,) * 12


linear_slice_rows.register_autograd(_backward_linear_rows, setup_context=_setup_linear_rows)

#: Operator name -> its Python implementation (lets tests trace allocations inside the loop).
IMPLEMENTATIONS = {
    f"{_LIB}::vocab_slice_stats": _vocab_slice_stats_impl,
    f"{_LIB}::vocab_slice_rows": _vocab_slice_rows_impl,
    f"{_LIB}::linear_slice_stats": _linear_slice_stats_impl,
    f"{_LIB}::linear_slice_rows": _linear_slice_rows_impl,
}
