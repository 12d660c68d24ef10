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
Operators take tensors plus the spec as one string; :func:`_operator` registers them.

**Adding a per-token loss over the vocabulary** (token log-probs, a divergence...): write its
``stats`` / ``width`` / ``combine`` / ``rows`` / ``grad`` chunk functions in
:mod:`functional_ce.chunk`, add a :class:`~functional_ce.chunk.LossMaths` entry (with its public
names) to ``chunk.LOSSES`` and its name to the choices of ``LossSpec.loss``, and call
:func:`loss_rows` from its public function with ``LossSpec(loss=...)``; a new option is a field
of ``LossSpec``. Statistics that combine across slices by a logsumexp are ``"lse"``; sums of per-slice
parts (a target logit, a logit sum) are ``"sum"``. The driver, the operators and the
vocabulary-parallel layout serve it unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .chunk import LOSSES, backward_into, forward_into, linear_backward_chunk, linear_fused_chunk, run_chunk
from .spec import LossSpec, Tokens, decode
from .weight_grad import LinearGrads, empty_grads

#: Operator name -> its Python implementation (lets tests trace allocations inside the loops).
IMPLEMENTATIONS: dict[str, Callable] = {}

Backward = Callable[..., dict[str, Optional[torch.Tensor]]]


def _operator(name: str, impl: Callable, fake: Callable, *, mutates: Sequence[str] = (),
              backward: Optional[Backward] = None, save: Sequence[str] = ()) -> Any:
    """Register ``impl`` as the custom operator ``functional_ce::name`` with its fake kernel.

    With ``backward``, autograd is registered too: ``save`` names the inputs (``impl``'s parameter
    names) and outputs (``"out0"``, ``"out1"``...) kept for backward (tensors through
    ``save_for_backward``, anything else as it is), which is called as
    ``backward(saved: dict, spec, needs: dict, grad_out0)`` and returns gradients by input name;
    inputs it leaves out get None. Only the first output is differentiable.
    """
    op = torch.library.custom_op(f"functional_ce::{name}", impl, mutates_args=tuple(mutates))
    op.register_fake(fake)
    IMPLEMENTATIONS[f"functional_ce::{name}"] = impl
    if backward is None:
        return op
    params = list(inspect.signature(impl).parameters)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        named = dict(zip(params, inputs), **{f"out{i}": o for i, o in enumerate(outputs)})
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.set_materialize_grads(False)  # no zero-filled gradients of the other outputs
        ctx.spec = decode(named["spec"])
        ctx.tensor_names = [n for n in save if named[n] is None or isinstance(named[n], torch.Tensor)]
        ctx.constants = {n: named[n] for n in save if n not in ctx.tensor_names}
        ctx.save_for_backward(*(named[n] for n in ctx.tensor_names))

    def autograd_backward(ctx: Any, grad: Optional[torch.Tensor], *unused: Any) -> tuple:
        if grad is None:
            return (None,) * len(params)
        saved = dict(zip(ctx.tensor_names, ctx.saved_tensors), **ctx.constants)
        grads = backward(saved, ctx.spec, dict(zip(params, ctx.needs_input_grad)), grad)
        return tuple(grads.get(p) for p in params)

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op


class _RefuseDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, what: str, n_grads: int, *tensors: torch.Tensor) -> tuple:
        ctx.what = what
        return tuple(t.view_as(t) for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        name, instead = ctx.what
        raise RuntimeError(
            f"functional_ce {name} does not support double backward (create_graph=True followed by "
            f"another backward through its gradients); use {instead} for that"
        )


def _refuse_double_backward(grads: tuple, inputs: tuple, spec: LossSpec) -> tuple:
    """``grads`` unchanged, or, under ``create_graph=True``, views of them whose backward raises
    (the gradients are closed-form, with no graph of their own to differentiate)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if g is not None]
    anchors = [t for t in inputs if t is not None]
    if not present or not any(t.requires_grad for t in anchors):
        return grads
    what = LOSSES[spec.loss].names[0 if spec.form == "logits" else 1]
    guarded = iter(_RefuseDoubleBackward.apply(what, len(present), *present, *anchors))
    return tuple(None if g is None else next(guarded) for g in grads)


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

    def take(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The valid rows of ``t`` ``[N, ...]``."""
        return t if self.index is None or t is None else t.index_select(0, self.index)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """``[n_valid, ...]`` back to ``[N, ...]``, zeros on the ignored rows."""
        if self.index is None:
            return t
        full = t.new_zeros((self.n, *t.shape[1:]))
        return full.index_copy_(0, self.index, t)


def _spans(n: int, spec: LossSpec):
    step = spec.rows_in(n)
    return (slice(start, min(start + step, n)) for start in range(0, n, step))


# --- step 1: statistics (step 2, the combine across shards, is distributed.vocab's) -----------


def _stats_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                labels: torch.Tensor, spec: str) -> torch.Tensor:
    """``[N, k]`` fp32 statistics of this vocabulary slice; ignored rows of the hidden-state form
    take part in no matmul (their statistics are 0)."""
    s = decode(spec)
    maths = LOSSES[s.loss]
    if (x.shape[1] if weight is None else weight.shape[0]) == 0:  # an empty slice: lse -inf, sums 0
        kinds = torch.tensor([k == "lse" for k in maths.combine[:maths.width(s)]], device=x.device)
        return torch.where(kinds, -torch.inf, 0.0).expand(x.shape[0], -1).contiguous()
    rows = ValidRows.of(labels, s.ignore_index) if s.form == "hidden" else ValidRows(x.shape[0], None)
    h, y = rows.take(x), rows.take(labels)
    out = torch.empty(h.shape[0], maths.width(s), dtype=torch.float32, device=x.device)
    for r in _spans(h.shape[0], s):
        run_chunk(forward_into, s, out[r], h[r], weight, bias, y[r], row_args=(0, 1, 4))
    return rows.put(out)


def _stats_fake(x, weight, bias, labels, spec):
    s = decode(spec)
    return x.new_empty((x.shape[0], LOSSES[s.loss].width(s)), dtype=torch.float32)


_stats = _operator("stats", _stats_impl, _stats_fake)


# --- step 3: rows, and their backward ----------------------------------------------------------


def _logits_grad_into_impl(grad_rows: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                           saved: torch.Tensor, out: torch.Tensor, spec: str) -> None:
    """Write the gradient of ``sum(grad_rows * loss_rows)`` w.r.t. ``logits`` ``[N, V]`` into
    ``out``: a buffer of the logits' shape and dtype, or ``logits`` itself (chunk by chunk, each
    chunk's gradient computed from its logits and then stored over them)."""
    s = decode(spec)
    for r in _spans(logits.shape[0], s):
        chunk = logits[r]
        target = chunk if out is logits else out[r]  # one view when writing in place
        run_chunk(backward_into, s, target, chunk, labels[r], saved[r], grad_rows[r], row_args=(0, 1, 2, 3, 4))


_logits_grad_into = _operator("logits_grad_into", _logits_grad_into_impl, lambda *args: None, mutates=("out",))


def _linear_grads_impl(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, needs: list[bool],
                       spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])`` of ``sum(grad_rows *
    loss_rows)``, recomputing each chunk's logits; an empty ``[0]`` where not in ``needs``."""
    s = decode(spec)
    rows = ValidRows.of(labels, s.ignore_index)
    h, y, saved, grad_rows = (rows.take(t) for t in (hidden, labels, saved, grad_rows))
    grads = LinearGrads(h, weight, bias, tuple(needs), s)
    for r in _spans(h.shape[0], s):
        grad_h, grad_logits = run_chunk(linear_backward_chunk, s, h[r], weight, bias, y[r], saved[r], grad_rows[r],
                                        row_args=(0, 3, 4, 5))
        grads.add(r.start, h[r], grad_h, grad_logits)
        del grad_h, grad_logits
    return grads.finish(rows)


_linear_grads = _operator("linear_grads", _linear_grads_impl,
                          lambda g, hidden, weight, bias, *rest: empty_grads(hidden, weight, bias, rest[-2]))


def _rows_backward(saved: dict, spec: LossSpec, needs: dict, grad_rows: torch.Tensor) -> dict:
    x, weight, bias, labels, kept = (saved[n] for n in ("x", "weight", "bias", "labels", "out1"))
    if spec.form == "logits":
        if not needs["x"]:
            return {}
        with torch.no_grad():
            out = x if spec.inplace_grad else torch.empty_like(x, memory_format=torch.contiguous_format)
            if x.shape[1] > 0:  # an empty vocabulary slice has nothing to write
                _logits_grad_into(grad_rows.float(), x, labels, kept, out, spec.encode())
        return {"x": _refuse_double_backward((out,), (x,), spec)[0]}
    want = (needs["x"], needs["weight"], bias is not None and needs["bias"])
    if not any(want):
        return {}
    with torch.no_grad():
        if weight.shape[0] == 0:  # an empty vocabulary slice: no logits, no gradient
            gh, gw, gb = torch.zeros_like(x), torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)
        else:
            gh, gw, gb = _linear_grads(grad_rows.float(), x, weight, bias, labels, kept, list(want), spec.encode())
    grads = tuple(g if w else None for g, w in zip((gh, gw, gb), want))
    return dict(zip(("x", "weight", "bias"), _refuse_double_backward(grads, (x, weight, bias), spec)))


def _rows_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], labels: torch.Tensor,
               stats: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_rows fp32 [N], saved fp32 [N, j])`` from the full-vocabulary statistics;
    differentiable in ``x`` (and ``weight``, ``bias``)."""
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss, saved.clone(memory_format=torch.contiguous_format)  # never a view of the input


def _rows_fake(x, weight, bias, labels, stats, spec):
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss.new_empty(loss.shape), saved.new_empty(saved.shape)


_rows = _operator("rows", _rows_impl, _rows_fake, backward=_rows_backward,
                  save=("x", "weight", "bias", "labels", "out1"))


# --- gradients in forward ----------------------------------------------------------------------


def _fused_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                coef: torch.Tensor, needs: list[bool], spec: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss fp32 [], loss_rows fp32 [N], grad_hidden [N, H], grad_weight [V, H], grad_bias [V])``
    with ``loss = sum(coef * loss_rows)`` over the whole vocabulary and the gradients of ``loss``."""
    s = decode(spec)
    rows = ValidRows.of(labels, s.ignore_index)
    h, y, c = rows.take(hidden), rows.take(labels), rows.take(coef)
    loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
    grads = LinearGrads(h, weight, bias, tuple(needs), s)
    for r in _spans(h.shape[0], s):
        loss_c, grad_h, grad_logits = run_chunk(linear_fused_chunk, s, h[r], weight, bias, y[r], c[r],
                                                row_args=(0, 3, 4))
        loss_rows[r] = loss_c
        grads.add(r.start, h[r], grad_h, grad_logits)
        del grad_h, grad_logits
    return ((loss_rows * c).sum(), rows.put(loss_rows), *grads.finish(rows))


def _fused_fake(hidden, weight, bias, labels, coef, needs, spec):
    scalar, rows = hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return (scalar, rows, *empty_grads(hidden, weight, bias, needs))


def _fused_backward(saved: dict, spec: LossSpec, needs: dict, grad_loss: torch.Tensor) -> dict:
    scale = grad_loss.float()
    with torch.no_grad():
        scaled = tuple(  # a 0-dim scale: each stays in its own dtype
            saved[f"out{i + 2}"] * scale if computed and needs[name] else None
            for i, (name, computed) in enumerate(zip(("hidden", "weight", "bias"), saved["needs"]))
        )
        grad_coef = saved["out1"] * scale if needs["coef"] else None
    grads = _refuse_double_backward(scaled, (saved["hidden"], saved["weight"], saved["bias"]), spec)
    return dict(zip(("hidden", "weight", "bias"), grads), coef=grad_coef)


_fused = _operator("fused", _fused_impl, _fused_fake, backward=_fused_backward,
                   save=("out1", "out2", "out3", "out4", "hidden", "weight", "bias", "needs"))


# --- the reduction ---------------------------------------------------------------------------


def _denominator(tokens: Tokens, spec: LossSpec) -> Union[float, torch.Tensor, None]:
    """What the weighted sum is divided by: None for a plain sum."""
    if tokens.num_label_tokens is not None:
        return tokens.num_label_tokens
    if spec.reduction == "mean":
        return (tokens.labels != spec.ignore_index).sum()
    return None


def _divide(x: torch.Tensor, count: Union[float, torch.Tensor, None]) -> torch.Tensor:
    """``x / count``, 0 where the count is 0."""
    if count is None:
        return x
    if isinstance(count, torch.Tensor):
        n = count.reshape(()).to(device=x.device, dtype=torch.float32)
        return torch.where(n > 0, x / torch.where(n > 0, n, 1.0), 0.0)
    return x / float(count) if count > 0 else x * 0.0


def row_coefficients(tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """``[N]`` fp32: each row's factor in the scalar loss (weight over denominator, 0 if ignored),
    so that the reduction equals ``sum(coef * loss_rows)``."""
    valid = (tokens.labels != spec.ignore_index).float()
    if tokens.weights is not None:
        valid = valid * tokens.weights.reshape(-1).float()
    return _divide(valid, _denominator(tokens, spec))


def reduce_rows(loss_rows: torch.Tensor, tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """Weights, then the reduction, of fp32 per-row losses ``[N]`` (0 on ignored rows): ``"mean"``
    divides the weighted sum by ``num_label_tokens`` when given, else by the number of valid
    tokens; ``"sum"`` by ``num_label_tokens`` when given. A count of 0 gives 0."""
    if tokens.weights is not None:
        loss_rows = loss_rows * tokens.weights.reshape(-1).float()
    if spec.reduction == "none":
        return loss_rows.reshape(tokens.batch_shape)
    return _divide(loss_rows.sum(), _denominator(tokens, spec))


# --- the entry point ---------------------------------------------------------------------------


def loss_rows(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], tokens: Tokens,
              spec: LossSpec, combine: Optional[Callable[[torch.Tensor, Sequence[str]], torch.Tensor]] = None
              ) -> torch.Tensor:
    """The loss of ``x`` ``[N, C]`` (logits, or hidden states with ``weight``/``bias``) reduced as
    ``spec`` says: fp32, a scalar or ``tokens.batch_shape``.

    ``combine(stats [N, k], kinds)`` turns one vocabulary slice's statistics into the full
    vocabulary's (vocabulary parallelism); None on one process.
    """
    encoded = spec.encode()
    if spec.form == "hidden":
        needs = [x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
        fused = spec.reduction != "none" and not spec.recompute_logits_in_backward and combine is None
        if fused and torch.is_grad_enabled() and any(needs):
            return _fused(x, weight, bias, tokens.labels, row_coefficients(tokens, spec), needs, encoded)[0]
    detached = [None if t is None else t.detach() for t in (x, weight, bias)]
    stats = _stats(*detached, tokens.labels, encoded)
    if combine is not None:
        stats = combine(stats, LOSSES[spec.loss].combine[:stats.shape[1]])
    rows, _ = _rows(x, weight, bias, tokens.labels, stats, encoded)
    return reduce_rows(rows, tokens, spec)
