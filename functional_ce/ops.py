"""Custom operators that run the chunk loop: opaque to torch.compile, with autograd registered.

``chunked_ce_forward`` saves only the caller's logits (no copy), the labels and the fp32 row
``logsumexp``; backward recomputes the softmax one fp32 chunk at a time. Because the loop lives
inside an operator with a fake kernel, a user's ``torch.compile(fullgraph=True)`` sees one node
whose output shapes follow the token count symbolically: no graph break and no recompilation
per chunk count.
"""

from __future__ import annotations

import torch

from .compiled import compile_flag, run_chunk
from .options import options_from_op_args

_LIB = "functional_ce"


def _chunked_ce_forward_impl(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    compile_chunks: int,
    inplace_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]``, ``labels [N]`` -> ``(loss_rows fp32 [N], lse fp32 [N])``."""
    opts = options_from_op_args(ignore_index, label_smoothing, z_loss, softcap)
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    flag = compile_flag(compile_chunks)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        run_chunk("forward", flag, loss[rows], lse[rows], logits[rows], labels[rows], opts=opts)
    return loss, lse


chunked_ce_forward = torch.library.custom_op(f"{_LIB}::chunked_ce_forward", _chunked_ce_forward_impl, mutates_args=())


@chunked_ce_forward.register_fake
def _(logits, labels, ignore_index, label_smoothing, z_loss, softcap, chunk_size, compile_chunks, inplace_grad):
    n = logits.shape[0]
    return (
        logits.new_empty(n, dtype=torch.float32),
        logits.new_empty(n, dtype=torch.float32),
    )


def _backward_loop(out, grad_rows, logits, labels, lse, opts, chunk_size, flag) -> None:
    n = logits.shape[0]
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        chunk = logits[rows]
        target = chunk if out is logits else out[rows]  # one view when writing in place
        run_chunk("backward", flag, target, chunk, labels[rows], lse[rows], grad_rows[rows], opts=opts)


def _chunked_ce_backward_impl(
    grad_rows: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    compile_chunks: int,
) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss_rows)`` w.r.t. ``logits``, a new ``[N, V]`` tensor."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    opts = options_from_op_args(ignore_index, label_smoothing, z_loss, softcap)
    _backward_loop(grad, grad_rows, logits, labels, lse, opts, chunk_size, compile_flag(compile_chunks))
    return grad


chunked_ce_backward = torch.library.custom_op(f"{_LIB}::chunked_ce_backward", _chunked_ce_backward_impl, mutates_args=())


@chunked_ce_backward.register_fake
def _(grad_rows, logits, labels, lse, ignore_index, label_smoothing, z_loss, softcap, chunk_size, compile_chunks):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _chunked_ce_backward_inplace_impl(
    grad_rows: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    compile_chunks: int,
) -> None:
    """As :func:`chunked_ce_backward`, but overwrites ``logits`` with the gradient, chunk by chunk."""
    opts = options_from_op_args(ignore_index, label_smoothing, z_loss, softcap)
    _backward_loop(logits, grad_rows, logits, labels, lse, opts, chunk_size, compile_flag(compile_chunks))


chunked_ce_backward_ = torch.library.custom_op(
    f"{_LIB}::chunked_ce_backward_", _chunked_ce_backward_inplace_impl, mutates_args=("logits",)
)


@chunked_ce_backward_.register_fake
def _(grad_rows, logits, labels, lse, ignore_index, label_smoothing, z_loss, softcap, chunk_size, compile_chunks):
    return None


def _setup_context(ctx, inputs, output) -> None:
    logits, labels, *scalars = inputs
    ctx.scalars = scalars  # ignore_index, label_smoothing, z_loss, softcap, chunk_size, compile_chunks, inplace
    ctx.save_for_backward(logits, labels, output[1])


def _backward(ctx, grad_loss, grad_lse):
    logits, labels, lse = ctx.saved_tensors
    *args, inplace_grad = ctx.scalars
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None,) * 9
    grad_loss = grad_loss.float()
    if inplace_grad:
        chunked_ce_backward_(grad_loss, logits, labels, lse, *args)
        grad = logits
    else:
        grad = chunked_ce_backward(grad_loss, logits, labels, lse, *args)
    return (grad,) + (None,) * 8


chunked_ce_forward.register_autograd(_backward, setup_context=_setup_context)


def refuse_double_backward(op, what: str, instead: str) -> None:
    """Give ``op`` (a backward operator) an autograd formula that raises a clear error."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"functional_ce {what} does not support double backward (create_graph=True followed by "
            f"another backward through its gradients); use {instead} for that"
        )

    def setup_context(ctx, inputs, output) -> None:
        pass

    op.register_autograd(backward, setup_context=setup_context)


refuse_double_backward(chunked_ce_backward, "cross_entropy", "torch.nn.functional.cross_entropy")

#: Operator name -> its Python implementation (lets tests trace allocations inside the loop).
IMPLEMENTATIONS = {
    f"{_LIB}::chunked_ce_forward": _chunked_ce_forward_impl,
    f"{_LIB}::chunked_ce_backward": _chunked_ce_backward_impl,
    f"{_LIB}::chunked_ce_backward_": _chunked_ce_backward_inplace_impl,
}
