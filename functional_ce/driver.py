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
Operators take tensors plus the spec as one string; :func:`functional_ce.operators.custom_operator`
registers them, and :mod:`functional_ce.reduction` reduces the per-row losses.

**Adding a per-token loss over the vocabulary**: write its chunk functions in a module of
:mod:`functional_ce.maths` (its statistics pass by pass, the kind of each statistic column, its
per-row outputs and its gradient), add a :class:`~functional_ce.maths.LossMaths` entry (with its
public names) to ``maths.LOSSES`` and its name to ``spec.LOSS_NAMES``, and call :func:`loss_rows`
from its public function with the spec :func:`functional_ce.inputs.make_spec` makes for it; a new
option is a field of ``LossSpec``. Statistics combine across slices by their kind: ``"lse"`` (a
logsumexp), ``"sum"`` (a target logit, a logit sum), ``"max"`` (a largest logit), ``"mean@j"`` (a mean under the slice's
softmax, such as the entropy's mean logit); a statistic that needs full-vocabulary values of
another goes in a later pass. The driver, the operators and the vocabulary-parallel layout serve
it unchanged (token log-probs and distillation were added so).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from .chunk import backward_into, forward_into, linear_backward_chunk, linear_fused_chunk
from .compiled_chunks import run_chunk
from .inputs import Tokens
from .maths import LOSSES
from .operators import custom_operator, refuse_double_backward
from .reduction import reduce_rows, row_coefficients
from .spec import LossSpec, decode
from .weight_grad import LinearGrads, empty_grads

_SixTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
# Every operator takes the loss's input (x, weight, bias) and a second one (x2, weight2, bias2:
# the teacher of a distillation loss; None otherwise).


def _stats_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
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
    rows = ValidRows.of(labels, s.ignore_index) if s.form == "hidden" else ValidRows(x.shape[0], None)
    h, h2, y, p = (rows.take(t) for t in (x, x2, labels, prior))
    out = torch.empty(h.shape[0], maths.width(s), dtype=torch.float32, device=x.device)
    for r in _spans(h.shape[0], s):
        run_chunk(forward_into, s, out[r], h[r], weight, bias, _rows_of(h2, r), weight2, bias2, y[r], _rows_of(p, r),
                  row_args=(0, 1, 4, 7, 8))
    return rows.put(out)


def _rows_of(t: Optional[torch.Tensor], r: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[r]


def _stats_fake(x, weight, bias, x2, weight2, bias2, labels, prior, spec):
    s = decode(spec)
    return x.new_empty((x.shape[0], LOSSES[s.loss].width(s)), dtype=torch.float32)


_stats = custom_operator("stats", _stats_impl, _stats_fake)


# --- step 3: rows, and their backward ----------------------------------------------------------


def _logits_grad_into_impl(grad_rows: torch.Tensor, logits: torch.Tensor, logits2: Optional[torch.Tensor],
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


_logits_grad_into = custom_operator("logits_grad_into", _logits_grad_into_impl, lambda *args: None,
                              mutates=("out", "out2"))


def _linear_grads_impl(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
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
    """The :class:`~functional_ce.weight_grad.LinearGrads` of each input: six gradients in all,
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


def _linear_grads_fake(g, hidden, weight, bias, hidden2, weight2, bias2, labels, saved, needs, spec):
    out = empty_grads(hidden, weight, bias, needs[:3])
    if hidden2 is not None and decode(spec).teacher_grad:
        return out + empty_grads(hidden2, weight2, bias2, needs[3:])
    return out + tuple(weight.new_empty(0) for _ in range(3))


_linear_grads = custom_operator("linear_grads", _linear_grads_impl, _linear_grads_fake)

_INPUTS = ("x", "weight", "bias", "x2", "weight2", "bias2")


def _rows_backward(saved: dict, spec: LossSpec, needs: dict, grad_rows: torch.Tensor) -> dict:
    x, weight, bias, x2, weight2, bias2, labels, kept = (saved[n] for n in (*_INPUTS, "labels", "out1"))
    inputs = (x, weight, bias, x2, weight2, bias2)
    if spec.form == "logits":
        want2 = x2 is not None and needs["x2"] and spec.teacher_grad
        if not (needs["x"] or want2):
            return {}
        with torch.no_grad():
            out = x if spec.inplace_grad else torch.empty_like(x, memory_format=torch.contiguous_format)
            out2 = torch.empty_like(x2, memory_format=torch.contiguous_format) if want2 else None
            if x.shape[1] > 0:  # an empty vocabulary slice has nothing to write
                _logits_grad_into(grad_rows.float(), x, x2, labels, kept, out, out2, spec.encode())
            elif out2 is not None:
                out2.zero_()
        grads = refuse_double_backward((out if needs["x"] else None, out2), (x, x2), spec)
        return dict(zip(("x", "x2"), grads))
    want = [t is not None and needs[n] for n, t in zip(_INPUTS, inputs)]
    want[3:] = [w and spec.teacher_grad for w in want[3:]]
    if not any(want):
        return {}
    with torch.no_grad():
        if weight.shape[0] == 0:  # an empty vocabulary slice: no logits, no gradient
            grads = tuple(None if t is None else torch.zeros_like(t) for t in inputs)
        else:
            grads = _linear_grads(grad_rows.float(), *inputs, labels, kept, want, spec.encode())
    grads = tuple(g if w else None for g, w in zip(grads, want))
    return dict(zip(_INPUTS, refuse_double_backward(grads, inputs, spec)))


def _rows_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               x2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
               labels: torch.Tensor, stats: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_rows fp32 [N] or [N, m], saved fp32 [N, j])`` from the full-vocabulary statistics;
    differentiable in ``x`` (and ``weight``, ``bias``, and the second input's)."""
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss, saved.clone(memory_format=torch.contiguous_format)  # never a view of the input


def _rows_fake(x, weight, bias, x2, weight2, bias2, labels, stats, spec):
    s = decode(spec)
    loss, saved = LOSSES[s.loss].rows(stats, labels, s)
    return loss.new_empty(loss.shape), saved.new_empty(saved.shape)


_rows = custom_operator("rows", _rows_impl, _rows_fake, backward=_rows_backward, save=(*_INPUTS, "labels", "out1"))


# --- gradients in forward ----------------------------------------------------------------------


def _fused_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
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


def _fused_fake(hidden, weight, bias, hidden2, weight2, bias2, labels, coef, needs, spec):
    scalar, rows = hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return (scalar, rows, *_linear_grads_fake(None, hidden, weight, bias, hidden2, weight2, bias2, labels, None,
                                              needs, spec))


_HEAD = ("hidden", "weight", "bias", "hidden2", "weight2", "bias2")


def _unit_scale(grad_loss: torch.Tensor) -> bool:
    """Whether the loss's incoming gradient is exactly 1 and reading it costs nothing: a CPU scalar
    outside tracing and functorch transforms (on an accelerator the read would wait for the device)."""
    if grad_loss.device.type != "cpu" or grad_loss.numel() != 1 or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active() or is_fake(grad_loss):
        return False
    return bool(grad_loss == 1)


def _fused_backward(saved: dict, spec: LossSpec, needs: dict, grad_loss: torch.Tensor) -> dict:
    computed = saved["needs"]
    # ``loss.backward()`` sends 1: the gradients computed in forward are handed on as they are,
    # not copied (a second [V, H] buffer for the weight's, while the saved one is alive). Autograd
    # frees what it saved before the gradient reaches AccumulateGrad, which then takes the buffer
    # as the parameter's .grad; with retain_graph=True it copies it instead, as for any gradient.
    scale = None if _unit_scale(grad_loss) else grad_loss.float()
    mul = (lambda t: t) if scale is None else (lambda t: t * scale)  # a 0-dim scale keeps each dtype
    with torch.no_grad():
        scaled = tuple(
            mul(saved[f"out{i + 2}"]) if computed[i] and needs[name] else None
            for i, name in enumerate(_HEAD)
        )
        grad_coef = mul(saved["out1"]) if needs["coef"] else None
    grads = refuse_double_backward(scaled, tuple(saved[n] for n in _HEAD), spec)
    return dict(zip(_HEAD, grads), coef=grad_coef)


def _fused_saves(named: dict) -> tuple[str, ...]:
    """The loss rows and the computed gradients (the second input's only when it gets them: its
    outputs are empty placeholders otherwise), the inputs and the flags."""
    second = named["hidden2"] is not None and decode(named["spec"]).teacher_grad
    return ("out1", "out2", "out3", "out4", *(("out5", "out6", "out7") if second else ()), *_HEAD, "needs")


_fused = custom_operator("fused", _fused_impl, _fused_fake, backward=_fused_backward, save=_fused_saves)


# --- the entry point ---------------------------------------------------------------------------


def loss_rows(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], tokens: Tokens,
              spec: LossSpec, combine: Optional[Callable[[torch.Tensor, Sequence[str]], torch.Tensor]] = None,
              second: Optional[tuple] = None) -> torch.Tensor:
    """The loss of ``x`` ``[N, C]`` (logits, or hidden states with ``weight``/``bias``) reduced as
    ``spec`` says: fp32, a scalar, ``tokens.batch_shape``, or ``[*batch_shape, m]`` for a loss
    with ``m`` outputs per row.

    ``second`` is the second input ``(x2, weight2, bias2)`` of a loss that reads two (the teacher
    of a distillation loss; its gradient is computed when ``spec.teacher_grad``).
    ``combine(stats [N, k], kinds)`` turns one vocabulary slice's statistics into the full
    vocabulary's (vocabulary parallelism); None on one process.
    """
    x2, weight2, bias2 = (None, None, None) if second is None else second
    encoded = spec.encode()
    if spec.form == "hidden":
        needs = [t is not None and t.requires_grad for t in (x, weight, bias, x2, weight2, bias2)]
        needs[3:] = [n and spec.teacher_grad for n in needs[3:]]
        fused = spec.reduction != "none" and not spec.recompute_logits_in_backward and combine is None
        if fused and torch.is_grad_enabled() and any(needs):
            coef = row_coefficients(tokens, spec)
            return _fused(x, weight, bias, x2, weight2, bias2, tokens.labels, coef, needs, encoded)[0]
    inputs = (x, weight, bias, x2, weight2, bias2)
    detached = [None if t is None else t.detach() for t in inputs]
    maths = LOSSES[spec.loss]
    if combine is None:
        stats = _stats(*detached, tokens.labels, None, encoded)
    else:  # pass by pass, each combined across the vocabulary's shards before the next
        stats = None
        for i, kinds in enumerate(maths.kinds(spec)):
            part = _stats(*detached, tokens.labels, stats, dataclasses.replace(spec, stats_pass=i).encode())
            part = combine(part, kinds)
            stats = part if stats is None else torch.cat([stats, part], dim=-1)
    rows, _ = _rows(*inputs, tokens.labels, stats, encoded)
    return reduce_rows(rows, tokens, spec)
