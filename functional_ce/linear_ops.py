"""Custom operators running the hidden-state chunk loop with the logits recomputed in backward.

``linear_ce_forward`` saves only what the caller already owns (hidden, weight, bias, labels)
plus the fp32 row ``logsumexp`` (O(N)). Backward recomputes each chunk's logits, returns the
hidden gradient chunk by chunk, and accumulates the weight (and bias) gradient in fp32, returned
in the weight's dtype. Rows whose label is ignored (or masked) are left out of every matmul.
No ``[N, V]`` tensor exists in forward or backward. This is the path of ``reduction="none"``
and of ``recompute_logits_in_backward=True``; :mod:`functional_ce.linear_fused` computes the
gradients in forward instead. As with
:mod:`functional_ce.ops`, the loop sits inside operators with fake kernels, so a user's
``torch.compile(fullgraph=True)`` sees one node per direction: no graph break, and no
recompilation when the token count or chunk count changes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from .compiled import accumulate_into, copy_into, run_chunk
from .double_backward import refuse_double_backward
from .linear_chunk import linear_chunk_backward, linear_chunk_forward
from .options import ChunkOptions

logger = logging.getLogger(__name__)

_LIB = "functional_ce"
#: Upper bound on the bytes of one low-precision weight-gradient partial (sliced over V).
_PARTIAL_BYTES = 32 * 1024 * 1024
#: The options key of the weight-gradient folds (they depend on no loss option).
_NO_OPTIONS = ChunkOptions()
#: Positions of the row-indexed tensors among the chunk functions' arguments: hidden and labels
#: in forward, plus lse and grad_rows in backward.
_FORWARD_ROWS = (0, 3)
_BACKWARD_ROWS = (0, 3, 4, 5)


def _linear_ce_forward_impl(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [N, H]``, ``weight [V, H]``, ``bias [V]?``, ``labels [N]`` -> fp32 ``(loss_rows, lse)`` ``[N]``."""
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    rows = ValidRows.of(labels, ignore_index)
    h, y = rows.take(hidden), rows.take(labels)
    n = h.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        loss_c, lse_c = run_chunk(linear_chunk_forward, compile_chunks, h[start:stop], weight, bias,
                                  y[start:stop], row_args=_FORWARD_ROWS, opts=opts)
        loss[start:stop] = loss_c
        lse[start:stop] = lse_c
    return rows.put(loss), rows.put(lse)


linear_ce_forward = torch.library.custom_op(f"{_LIB}::linear_ce_forward", mutates_args=())(_linear_ce_forward_impl)


@linear_ce_forward.register_fake
def _(hidden, weight, bias, labels, *options):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class ValidRows:
    """The rows that carry a loss (label != ignore_index), so ignored rows cost no matmul.

    ``index`` is None when every row is valid (nothing is gathered then).
    """

    n: int
    index: Optional[torch.Tensor]

    @staticmethod
    def of(labels: torch.Tensor, ignore_index: int) -> "ValidRows":
        valid = labels != ignore_index
        if bool(valid.all()):  # one host read-back per call (a sync on GPU)
            return ValidRows(labels.shape[0], None)
        return ValidRows(labels.shape[0], valid.nonzero().squeeze(1))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The valid rows of ``t`` ``[N, ...]``."""
        return t if self.index is None else t.index_select(0, self.index)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """``[n_valid, ...]`` back to ``[N, ...]``, zeros on the ignored rows."""
        if self.index is None:
            return t
        full = t.new_zeros((self.n, *t.shape[1:]))
        return full.index_copy_(0, self.index, t)


#: ``(device type, dtype)`` -> whether the backend multiplies two matrices of that dtype into an
#: fp32 output in one matmul (``aten::addmm.dtype_out``: CUDA in recent torch releases).
_FP32_OUT_MATMUL: dict[tuple[str, torch.dtype], bool] = {}


def fp32_out_matmul_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``aten::addmm.dtype_out`` / ``aten::mm.dtype_out`` multiply ``dtype`` matrices into
    an fp32 ``out`` on ``device``'s backend, correctly (checked once per backend and dtype on a
    small case: ``+=`` into an fp32 ``out``, and ``=`` over an ``out`` full of NaN)."""
    key = (device.type, dtype)
    if key not in _FP32_OUT_MATMUL:
        ok = False
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            a64, b64 = torch.randn(24, 16, generator=g, dtype=torch.float64), torch.randn(16, 8, generator=g,
                                                                                       dtype=torch.float64)
            a, b = a64.to(device=device, dtype=dtype), b64.to(device=device, dtype=dtype)
            ref = a.double().cpu() @ b.double().cpu()
            out = torch.full((24, 8), float("nan"), dtype=torch.float32, device=device)
            torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=out)
            torch.ops.aten.addmm.dtype_out(out, a, b, torch.float32, out=out)
            ok = bool(torch.allclose(out.double().cpu(), 2 * ref, rtol=1e-5, atol=1e-5))
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            logger.debug("no fp32-output %s matmul on %s: %s", dtype, device.type, exc)
        _FP32_OUT_MATMUL[key] = ok
    return _FP32_OUT_MATMUL[key]


def add_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden_c: torch.Tensor, *,
                    first: bool = False, compile_chunks: Optional[bool] = None) -> None:
    """``acc [V, H] fp32 += grad_logits.T @ hidden_c`` (``first``: ``=`` instead of ``+=``, so
    ``acc`` may start uninitialised).

    fp32 inputs accumulate straight into ``acc``. Low-precision ones do too where the backend has
    a matmul with an fp32 output (:func:`fp32_out_matmul_supported`: cuBLAS adds into ``acc`` in
    the matmul's own epilogue). Elsewhere (CPU) they go through one low-precision partial, sliced
    over V so it stays under ``_PARTIAL_BYTES``, folded into ``acc`` by a compiled one-pass kernel
    (eager ``add_`` of a bf16 tensor into an fp32 one converts through a temporary first, several
    times slower on CPU; see :func:`functional_ce.compiled.accumulate_into`).
    """
    if grad_logits.dtype == torch.float32:
        acc.addmm_(grad_logits.t(), hidden_c, beta=0 if first else 1)  # beta=0 ignores acc, NaN included
        return
    if fp32_out_matmul_supported(acc.device, grad_logits.dtype):
        if first:
            torch.ops.aten.mm.dtype_out(grad_logits.t(), hidden_c, torch.float32, out=acc)
        else:
            torch.ops.aten.addmm.dtype_out(acc, grad_logits.t(), hidden_c, torch.float32, out=acc)
        return
    v, h = acc.shape
    step = max(1, min(v, _PARTIAL_BYTES // max(1, h * grad_logits.element_size())))
    partial = torch.empty((step, h), dtype=grad_logits.dtype, device=acc.device)
    fold = copy_into if first else accumulate_into
    for v0 in range(0, v, step):
        v1 = min(v0 + step, v)
        out = partial[: v1 - v0]
        torch.mm(grad_logits[:, v0:v1].t(), hidden_c, out=out)
        run_chunk(fold, compile_chunks, acc[v0:v1], out, row_args=(0, 1), opts=_NO_OPTIONS)


class LinearGrads:
    """The gradients of hidden, weight and bias, filled chunk by chunk.

    Hidden-gradient rows are written in place; weight and bias gradients are accumulated in
    fp32 and returned in their own dtype. A gradient that was not asked for is an empty ``[0]``.
    """

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 need_hidden: bool, need_weight: bool, need_bias: bool,
                 compile_chunks: Optional[bool] = None) -> None:
        dev = h.device
        self.weight, self.bias = weight, bias
        self.grad_h = torch.empty_like(h, memory_format=torch.contiguous_format) if need_hidden else h.new_empty(0)
        self.need_hidden = need_hidden
        # written by the first chunk (no zero-fill pass); zeros if no chunk comes (every row ignored)
        self.acc_w = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_weight else None
        self.acc_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias else None
        self.compile_chunks = compile_chunks
        self.chunks = 0

    def add(self, start: int, h_c: torch.Tensor, grad_h_c: torch.Tensor, grad_logits: torch.Tensor) -> None:
        """Fold one chunk in: ``grad_h_c [c, H]`` are rows ``start:start+c``; ``grad_logits [c, V]``."""
        if self.need_hidden:
            self.grad_h[start:start + h_c.shape[0]] = grad_h_c
        if self.acc_w is not None:
            add_weight_grad(self.acc_w, grad_logits, h_c, first=self.chunks == 0, compile_chunks=self.compile_chunks)
        if self.acc_b is not None:
            self.acc_b += grad_logits.sum(dim=0, dtype=torch.float32)
        self.chunks += 1

    def finish(self, rows: "ValidRows") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])``, ignored rows back as zeros."""
        if self.acc_w is not None and self.chunks == 0:
            self.acc_w.zero_()
        grad_w = self.weight.new_empty(0) if self.acc_w is None else self.acc_w
        if self.acc_w is not None and self.acc_w.dtype != self.weight.dtype:
            # the final cast in one compiled pass too (eager .to() is slower on CPU)
            grad_w = torch.empty(self.acc_w.shape, dtype=self.weight.dtype, device=self.acc_w.device)
            run_chunk(copy_into, self.compile_chunks, grad_w, self.acc_w, row_args=(0, 1), opts=_NO_OPTIONS)
        self.acc_w = None
        has_b = self.acc_b is not None and self.bias is not None
        grad_b = self.acc_b.to(self.bias.dtype) if has_b else self.weight.new_empty(0)
        grad_h = rows.put(self.grad_h) if self.need_hidden else self.grad_h
        return grad_h, grad_w, grad_b


def _linear_ce_backward_impl(
    grad_rows: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    lse: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_rows * loss_rows)`` w.r.t. hidden, weight and bias.

    Returns ``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])`` in the input dtypes; a
    gradient that was not asked for comes back as an empty ``[0]`` tensor.
    """
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)
    rows = ValidRows.of(labels, ignore_index)
    h, y, lse, grad_rows = (rows.take(t) for t in (hidden, labels, lse, grad_rows))
    grads = LinearGrads(h, weight, bias, need_hidden, need_weight, need_bias, compile_chunks)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        h_c = h[start:stop]
        grad_h_c, grad_logits = run_chunk(
            linear_chunk_backward, compile_chunks, h_c, weight, bias, y[start:stop], lse[start:stop],
            grad_rows[start:stop], row_args=_BACKWARD_ROWS, opts=opts,
        )
        grads.add(start, h_c, grad_h_c, grad_logits)
        del grad_h_c, grad_logits
    return grads.finish(rows)


linear_ce_backward = torch.library.custom_op(f"{_LIB}::linear_ce_backward", mutates_args=())(
    _linear_ce_backward_impl
)


@linear_ce_backward.register_fake
def _(grad_rows, hidden, weight, bias, labels, lse, *options_and_needs):
    need_hidden, need_weight, need_bias = options_and_needs[-3:]
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0)
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if (need_bias and bias is not None) else weight.new_empty(0)
    return grad_h, grad_w, grad_b


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, bias, labels, *options, chunk_size, compile_chunks = inputs
    ctx.opts = ChunkOptions(*options)
    ctx.chunk_size = chunk_size
    ctx.compile_chunks = compile_chunks
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])


def recomputed_gradients(ctx: Any, grad_rows: Optional[torch.Tensor]) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` (None where not needed) of ``sum(grad_rows *
    loss_rows)``, recomputing each chunk's logits from what ``ctx`` saved: ``hidden``, ``weight``,
    ``bias``, ``labels`` and the full-vocabulary ``lse`` (a vocabulary slice when ``ctx.opts`` says
    so), plus ``ctx.opts``, ``ctx.chunk_size``, ``ctx.compile_chunks`` and ``ctx.has_bias``.
    Double backward through them raises."""
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = bool(need_b and ctx.has_bias)
    if grad_rows is None or not (need_h or need_w or need_b):
        return (None, None, None)
    with torch.no_grad():
        if weight.shape[0] == 0:  # an empty vocabulary slice: no logits, no gradient
            gh, gw = torch.zeros_like(hidden), torch.zeros_like(weight)
            gb = None if bias is None else torch.zeros_like(bias)
        else:
            gh, gw, gb = linear_ce_backward(
                grad_rows.float(), hidden, weight, bias, labels, lse, *ctx.opts.op_args(), ctx.chunk_size,
                ctx.compile_chunks, need_h, need_w, need_b,
            )
    grads = (gh if need_h else None, gw if need_w else None, gb if need_b else None)
    return refuse_double_backward(
        grads, (hidden, weight, bias), "linear_cross_entropy", "F.linear + torch.nn.functional.cross_entropy"
    )


def _backward(ctx: Any, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]) -> tuple:
    return recomputed_gradients(ctx, grad_loss) + (None,) * 9


linear_ce_forward.register_autograd(_backward, setup_context=_setup_context)


#: Operator name -> its Python implementation (lets tests trace allocations inside the loop).
IMPLEMENTATIONS = {
    f"{_LIB}::linear_ce_forward": _linear_ce_forward_impl,
    f"{_LIB}::linear_ce_backward": _linear_ce_backward_impl,
}
