"""The hidden-state form's gradients, filled chunk by chunk: hidden-gradient rows in place, the
weight and bias gradients accumulated in fp32 and returned in their own dtype."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .chunk import accumulate_into, copy_into
from .compiled_chunks import run_chunk
from .spec import LossSpec

logger = logging.getLogger(__name__)

#: Upper bound on the bytes of one low-precision weight-gradient partial (sliced over V).
_PARTIAL_BYTES = 32 * 1024 * 1024

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
            a64 = torch.randn(24, 16, generator=g, dtype=torch.float64)
            b64 = torch.randn(16, 8, generator=g, dtype=torch.float64)
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


def add_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden_c: torch.Tensor, spec: LossSpec, *,
                    first: bool = False) -> None:
    """``acc [V, H] fp32 += grad_logits.T @ hidden_c`` (``first``: ``=`` instead of ``+=``, so
    ``acc`` may start uninitialised).

    fp32 inputs accumulate straight into ``acc``. Low-precision ones do too where the backend has
    a matmul with an fp32 output (:func:`fp32_out_matmul_supported`: cuBLAS adds into ``acc`` in
    the matmul's own epilogue). Elsewhere (CPU) they go through one low-precision partial, sliced
    over V so it stays under ``_PARTIAL_BYTES``, folded into ``acc`` by a compiled one-pass kernel
    (eager ``add_`` of a bf16 tensor into an fp32 one converts through a temporary first, several
    times slower on CPU). ``spec`` gives the compile choice.
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
        run_chunk(fold, spec, acc[v0:v1], out, row_args=(0, 1))


class LinearGrads:
    """The gradients of hidden, weight and bias, filled chunk by chunk.

    A gradient that was not asked for is an empty ``[0]``.
    """

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 needs: tuple[bool, bool, bool], spec: LossSpec) -> None:
        need_hidden, need_weight, need_bias = needs
        dev = h.device
        self.weight, self.bias = weight, bias
        self.grad_h = torch.empty_like(h, memory_format=torch.contiguous_format) if need_hidden else h.new_empty(0)
        self.need_hidden = need_hidden
        # written by the first chunk (no zero-fill pass); zeros if no chunk comes (every row ignored)
        self.acc_w = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_weight else None
        self.acc_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias else None
        # the folds depend on no loss option: one compiled graph whatever the loss
        self.fold_spec = LossSpec(compile_chunks=spec.compile_chunks)
        self.chunks = 0

    def add(self, start: int, h_c: torch.Tensor, grad_h_c: torch.Tensor, grad_logits: torch.Tensor) -> None:
        """Fold one chunk in: ``grad_h_c [c, H]`` are rows ``start:start+c``; ``grad_logits [c, V]``."""
        if self.need_hidden:
            self.grad_h[start:start + h_c.shape[0]] = grad_h_c
        if self.acc_w is not None:
            add_weight_grad(self.acc_w, grad_logits, h_c, self.fold_spec, first=self.chunks == 0)
        if self.acc_b is not None:
            self.acc_b += grad_logits.sum(dim=0, dtype=torch.float32)
        self.chunks += 1

    def finish(self, rows: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])``, ignored rows back as zeros
        (``rows``: the driver's ``ValidRows``, which puts the valid rows back in place)."""
        if self.acc_w is not None and self.chunks == 0:
            self.acc_w.zero_()
        grad_w = self.weight.new_empty(0) if self.acc_w is None else self.acc_w
        if self.acc_w is not None and self.acc_w.dtype != self.weight.dtype:
            # the final cast in one compiled pass too (eager .to() is slower on CPU)
            grad_w = torch.empty(self.acc_w.shape, dtype=self.weight.dtype, device=self.acc_w.device)
            run_chunk(copy_into, self.fold_spec, grad_w, self.acc_w, row_args=(0, 1))
        self.acc_w = None
        has_b = self.acc_b is not None and self.bias is not None
        grad_b = self.acc_b.to(self.bias.dtype) if has_b else self.weight.new_empty(0)
        grad_h = rows.put(self.grad_h) if self.need_hidden else self.grad_h
        return grad_h, grad_w, grad_b


def empty_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fake (shape-only) form of :meth:`LinearGrads.finish`."""
    need_hidden, need_weight, need_bias = needs
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0)
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if (need_bias and bias is not None) else weight.new_empty(0)
    return grad_h, grad_w, grad_b
