"""Custom operators that run the chunk loop of the logits form: opaque to torch.compile, with
autograd registered.

``chunked_ce_forward`` saves only the caller's logits (no copy), the labels and the fp32 row
``logsumexp``; ``chunked_ce_backward_into`` recomputes the softmax one fp32 chunk at a time and
writes the gradient into a buffer it is given: a new gradient tensor, or the logits themselves
(``inplace_grad``). Because the loop lives inside operators with fake kernels, a user's
``torch.compile(fullgraph=True)`` sees one node per direction whose output shapes follow the
token count symbolically: no graph break and no recompilation per chunk count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .compiled import backward_into, forward_into, run_chunk
from .double_backward import refuse_double_backward
from .options import ChunkOptions

_LIB = "functional_ce"


def _chunked_ce_forward_impl(
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
    inplace_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]``, ``labels [N]`` -> ``(loss_rows fp32 [N], lse fp32 [N])``.

    ``inplace_grad`` only tells the backward formula where to write the gradient.
    """
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        run_chunk(forward_into, compile_chunks, loss[rows], lse[rows], logits[rows], labels[rows],
                  row_args=(0, 1, 2, 3), opts=opts)
    return loss, lse


chunked_ce_forward = torch.library.custom_op(f"{_LIB}::chunked_ce_forward", _chunked_ce_forward_impl, mutates_args=())


@chunked_ce_forward.register_fake
def _(logits, labels, *options):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


def _chunked_ce_backward_into_impl(
    grad_rows: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    vocab_start: int,
    n_classes: Optional[int],
    chunk_size: int,
    compile_chunks: Optional[bool],
) -> None:
    """Write the gradient of ``sum(grad_rows * loss_rows)`` w.r.t. ``logits`` into ``out`` ``[N, V]``.

    ``out`` is a buffer of the logits' shape and dtype, or ``logits`` itself: each chunk's
    gradient is computed from the chunk's logits and then stored over them.
    """
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    n = logits.shape[0]
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        chunk = logits[rows]
        target = chunk if out is logits else out[rows]  # one view when writing in place
        run_chunk(backward_into, compile_chunks, target, chunk, labels[rows], lse[rows], grad_rows[rows],
                  row_args=(0, 1, 2, 3, 4), opts=opts)


chunked_ce_backward_into = torch.library.custom_op(
    f"{_LIB}::chunked_ce_backward_into", _chunked_ce_backward_into_impl, mutates_args=("out",)
)


@chunked_ce_backward_into.register_fake
def _(grad_rows, logits, labels, lse, out, *options):
    return None


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    logits, labels, *options, chunk_size, compile_chunks, inplace = inputs
    ctx.opts = ChunkOptions(*options)
    ctx.chunk_size = chunk_size
    ctx.compile_chunks = compile_chunks
    ctx.inplace_grad = inplace
    ctx.save_for_backward(logits, labels, output[1])


def logits_gradient(
    grad_rows: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, opts: ChunkOptions,
    chunk_size: int, compile_chunks: Optional[bool], inplace_grad: bool,
) -> torch.Tensor:
    """The gradient of ``sum(grad_rows * loss_rows)`` w.r.t. ``logits`` ``[N, V]`` (a slice of the
    vocabulary when ``opts`` says so), given the full-vocabulary ``lse``: written into the logits
    themselves with ``inplace_grad``, else into a new buffer; double backward through it raises."""
    with torch.no_grad():
        out = logits if inplace_grad else torch.empty_like(logits, memory_format=torch.contiguous_format)
        if logits.shape[1] > 0:  # an empty vocabulary slice has nothing to write
            chunked_ce_backward_into(grad_rows.float(), logits, labels, lse, out, *opts.op_args(), chunk_size,
                                     compile_chunks)
    (grad,) = refuse_double_backward((out,), (logits,), "cross_entropy", "torch.nn.functional.cross_entropy")
    return grad


def _backward(ctx: Any, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]) -> tuple:
    logits, labels, lse = ctx.saved_tensors
    no_grads = (None,) * 10
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None,) + no_grads
    grad = logits_gradient(grad_loss, logits, labels, lse, ctx.opts, ctx.chunk_size, ctx.compile_chunks,
                           ctx.inplace_grad)
    return (grad,) + no_grads


chunked_ce_forward.register_autograd(_backward, setup_context=_setup_context)

#: Operator name -> its Python implementation (lets tests trace allocations inside the loop).
IMPLEMENTATIONS = {
    f"{_LIB}::chunked_ce_forward": _chunked_ce_forward_impl,
    f"{_LIB}::chunked_ce_backward_into": _chunked_ce_backward_into_impl,
}
