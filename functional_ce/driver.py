"""The chunk driver: one loop over chunks of token rows for every loss, form and layout.

Inputs are ``x`` ``[N, C]`` with, for the hidden-state form, ``weight`` ``[V, H]`` and ``bias``
(``x`` is then ``hidden``; otherwise it is the logits), labels ``[N]``, and a
:class:`~functional_ce.spec.LossSpec`. ``V`` may be this process's slice of a sharded vocabulary
(``spec.vocab_start``); one process is the one-slice case. A loss runs in three steps:

1. ``stats``: each chunk's logits (built per chunk from hidden states) give ``[N, k]`` fp32
   per-row statistics of the slice (the loss's ``stats`` chunk function; no autograd);
2. ``combine`` (given only when the vocabulary is sharded: O(N) collectives in traceable Python,
   :func:`functional_ce.distributed.vocab.combine_stats`) turns them into full-vocabulary ones;
3. ``rows``: the loss's ``rows`` function gives each token's loss (O(N) work), and carries the
   autograd formula: backward recomputes each chunk's logits and calls the loss's ``grad``
   function, writing the logits' gradient (in place with ``inplace_grad``) or folding it into the
   hidden, weight and bias gradients. Nothing is communicated in backward.

For a scalar reduction from hidden states on one slice, gradients are computed in forward instead
(``fused``: each chunk's logits exist once; backward scales the saved gradients), unless
``recompute_logits_in_backward``. Each step is a custom operator with a fake kernel, so a user's
``torch.compile(fullgraph=True)`` sees one node per step: no graph break, no recompile per chunk.
Operators take tensors plus the spec as one string; :mod:`functional_ce.operators` registers this
module's loops as those operators (with their backward formulas) and holds ``loss_rows``, the
entry point; :func:`functional_ce.inputs.reduce_rows` reduces the per-row losses.

**Adding a per-token loss over the vocabulary**: write its chunk functions in a module of
:mod:`functional_ce.maths` (its statistics pass by pass, the kind of each statistic column, its
per-row outputs and its gradient), add a :class:`~functional_ce.maths.LossMaths` entry (with its
public names) to ``maths.LOSSES`` and its name to ``spec.LOSS_NAMES``, and call
:func:`functional_ce.operators.loss_rows`
from its public function with the spec :func:`functional_ce.inputs.make_spec` makes for it; a new
option is a field of ``LossSpec``. Statistics combine across slices by their kind: ``"lse"`` (a
logsumexp), ``"sum"`` (a target logit, a logit sum), ``"max"`` (a largest logit), ``"mean@j"`` (a mean under the slice's
softmax, such as the entropy's mean logit); a statistic that needs full-vocabulary values of
another goes in a later pass. The driver, the operators and the vocabulary-parallel layout serve
it unchanged (token log-probs and distillation were added so).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from .chunk import accumulate_into, backward_into, copy_into, forward_into, linear_backward_chunk, linear_fused_chunk
from .compiled_chunks import run_chunk
from .inputs import ValidRows
from .maths import LOSSES
from .spec import LossSpec, decode

logger = logging.getLogger(__name__)

_SixTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _spans(n: int, spec: LossSpec):
    step = spec.rows_in(n)
    return (slice(start, min(start + step, n)) for start in range(0, n, step))


# --- step 1: statistics (step 2, the combine across shards, is distributed.vocab's) -----------
# Every operator takes the loss's input (x, weight, bias) and a second one (x2, weight2, bias2:
# the teacher of a distillation loss; None otherwise).


def stats_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                x2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
                labels: torch.Tensor, prior: Optional[torch.Tensor], spec: str) -> torch.Tensor:
    """``[N, k]`` fp32 statistics of this vocabulary slice (pass ``spec.stats_pass``, given the
    previous passes' ``prior``, or every pass); ignored rows of the hidden-state form take part in
    no matmul (their statistics are 0)."""
    s = decode(spec)
    maths = LOSSES[s.loss]
    if (x.shape[1] if weight is None else weight.shape[0]) == 0:  # an empty slice: lse and max -inf, sums 0
        kinds = maths.kinds(s)
        kinds = [k for ks in kinds for k in ks] if s.stats_pass < 0 else kinds[s.stats_pass]
        is_lse = torch.tensor([k in ("lse", "max") for k in kinds], device=x.device)
        return torch.where(is_lse, -torch.inf, 0.0).expand(x.shape[0], -1).contiguous()
    rows = ValidRows.of(labels, s.ignore_index) if s.form == "linear" else ValidRows(x.shape[0], None)
    h, h2, y, p = (rows.take(t) for t in (x, x2, labels, prior))
    out = torch.empty(h.shape[0], maths.width(s), dtype=torch.float32, device=x.device)
    for r in _spans(h.shape[0], s):
        run_chunk(forward_into, s, out[r], h[r], weight, bias, _rows_of(h2, r), weight2, bias2, y[r], _rows_of(p, r),
                  row_args=(0, 1, 4, 7, 8))
    return rows.put(out)


def _rows_of(t: Optional[torch.Tensor], r: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[r]


def stats_fake(x, weight, bias, x2, weight2, bias2, labels, prior, spec):
    s = decode(spec)
    return x.new_empty((x.shape[0], LOSSES[s.loss].width(s)), dtype=torch.float32)


# --- step 3: rows, and their backward ----------------------------------------------------------


def logits_grad_into_impl(grad_rows: torch.Tensor, logits: torch.Tensor, logits2: Optional[torch.Tensor],
                           labels: torch.Tensor, saved: torch.Tensor, out: torch.Tensor,
                           out2: Optional[torch.Tensor], spec: str) -> None:
    """Write the gradient of ``sum(grad_rows * loss_rows)`` w.r.t. ``logits`` ``[N, V]`` into
    ``out``: a buffer of the logits' shape and dtype, or ``logits`` itself (chunk by chunk, each
    chunk's gradient computed from its logits and then stored over them); the second input's
    (``logits2``) into ``out2`` when given."""
    s = decode(spec)
    for r in _spans(logits.shape[0], s):
        chunk = logits[r]
        target = chunk if out is logits else out[r]  # one view when writing in place
        run_chunk(backward_into, s, target, _rows_of(out2, r), chunk, _rows_of(logits2, r), labels[r], saved[r],
                  grad_rows[r], row_args=(0, 1, 2, 3, 4, 5, 6))


def linear_grads_impl(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], hidden2: Optional[torch.Tensor], weight2: Optional[torch.Tensor],
                       bias2: Optional[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, needs: list[bool],
                       spec: str) -> _SixTensors:
    """``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])`` of ``sum(grad_rows *
    loss_rows)``, then the second input's, recomputing each chunk's logits; an empty ``[0]`` where
    not in ``needs`` (six flags)."""
    s = decode(spec)
    rows = ValidRows.of(labels, s.ignore_index)
    h, h2, y, saved, grad_rows = (rows.take(t) for t in (hidden, hidden2, labels, saved, grad_rows))
    grads = _Grads(h, weight, bias, h2, weight2, bias2, needs, s)
    for r in _spans(h.shape[0], s):
        chunk_grads = run_chunk(linear_backward_chunk, s, h[r], weight, bias, _rows_of(h2, r), weight2, bias2, y[r],
                                saved[r], grad_rows[r], row_args=(0, 3, 6, 7, 8))
        grads.add(r, h, h2, chunk_grads)
        del chunk_grads
    return grads.finish(rows)


class _Grads:
    """The :class:`LinearGrads` of each input: six gradients in all,
    the second input's three empty ``[0]`` when there is none or it gets no gradient."""

    def __init__(self, h, weight, bias, h2, weight2, bias2, needs: Sequence[bool], spec: LossSpec) -> None:
        self.heads = [LinearGrads(h, weight, bias, tuple(needs[:3]), spec)]
        if h2 is not None and spec.teacher_grad:
            self.heads.append(LinearGrads(h2, weight2, bias2, tuple(needs[3:]), spec))
        self.empty = tuple(weight.new_empty(0) for _ in range(3 * (2 - len(self.heads))))

    def add(self, r: slice, h: torch.Tensor, h2: Optional[torch.Tensor], chunk_grads: Sequence) -> None:
        for head, x, (grad_h, grad_logits) in zip(self.heads, (h, h2), zip(chunk_grads[::2], chunk_grads[1::2])):
            head.add(r.start, x[r], grad_h, grad_logits)

    def finish(self, rows: "ValidRows") -> tuple[torch.Tensor, ...]:
        return tuple(g for head in self.heads for g in head.finish(rows)) + self.empty


def linear_grads_fake(g, hidden, weight, bias, hidden2, weight2, bias2, labels, saved, needs, spec):
    out = empty_grads(hidden, weight, bias, needs[:3])
    if hidden2 is not None and decode(spec).teacher_grad:
        return out + empty_grads(hidden2, weight2, bias2, needs[3:])
    return out + tuple(weight.new_empty(0) for _ in range(3))


def rows_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               x2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
               labels: torch.Tensor, stats: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_rows fp32 [N] or [N, m], saved fp32 [N, j])`` from the full-vocabulary statistics;
    differentiable in ``x`` (and ``weight``, ``bias``, and the second input's)."""
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss, saved.clone(memory_format=torch.contiguous_format)  # never a view of the input


def rows_fake(x, weight, bias, x2, weight2, bias2, labels, stats, spec):
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss.new_empty(loss.shape), saved.new_empty(saved.shape)


# --- gradients in forward ----------------------------------------------------------------------


def fused_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                hidden2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
                labels: torch.Tensor, coef: torch.Tensor, needs: list[bool], spec: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """``(loss fp32 [], loss_rows fp32 [N], grad_hidden [N, H], grad_weight [V, H], grad_bias [V],
    ...the second input's three when it is given)`` with ``loss = sum(coef * loss_rows)`` over the
    whole vocabulary and the gradients of ``loss``."""
    s = decode(spec)
    rows = ValidRows.of(labels, s.ignore_index)
    h, h2, y, c = (rows.take(t) for t in (hidden, hidden2, labels, coef))
    loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
    grads = _Grads(h, weight, bias, h2, weight2, bias2, needs, s)
    for r in _spans(h.shape[0], s):
        loss_c, *chunk_grads = run_chunk(linear_fused_chunk, s, h[r], weight, bias, _rows_of(h2, r), weight2, bias2,
                                         y[r], c[r], row_args=(0, 3, 6, 7))
        loss_rows[r] = loss_c
        grads.add(r, h, h2, chunk_grads)
        del chunk_grads
    return ((loss_rows * c).sum(), rows.put(loss_rows), *grads.finish(rows))


def fused_fake(hidden, weight, bias, hidden2, weight2, bias2, labels, coef, needs, spec):
    scalar, rows = hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return (scalar, rows, *linear_grads_fake(None, hidden, weight, bias, hidden2, weight2, bias2, labels, None,
                                              needs, spec))


# --- the hidden-state form's gradients, filled chunk by chunk ----------------------------------
# Hidden-gradient rows in place; the weight and bias gradients accumulated in fp32 and returned in
# their own dtype.

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
