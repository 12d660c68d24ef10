"""The per-chunk maths: pure functions, the graphs that torch.compile sees, and how they run.

A loss over the vocabulary is three pure functions of one chunk of rows (a :class:`LossMaths`
entry of :data:`LOSSES`; ``spec`` is the call's :class:`~functional_ce.spec.LossSpec`):

- ``stats(z, labels, spec) -> [c, k]`` fp32 (``k = width(spec)``): per-row statistics of a
  chunk of logits ``z`` ``[c, V_slice]`` (the columns from ``spec.vocab_start`` on), column ``i``
  of the kind ``combine[i]`` that says how vocabulary slices combine: ``"lse"`` (a logsumexp,
  combined by a logsumexp) or ``"sum"`` (summed).
- ``rows(stats, labels, spec) -> (loss [c], saved [c, j])``: each row's loss from the
  full-vocabulary statistics, and the ``j`` fp32 values per row its gradient needs.
- ``grad(z, labels, saved, grad_rows, spec) -> [c, V_slice]``: the gradient of
  ``sum(grad_rows * loss)`` with respect to the chunk's logits, in their dtype.

The ``*_chunk`` / ``*_into`` functions below are the graphs the driver runs per chunk: they build
a chunk's logits (``hidden @ weight.T + bias`` for the hidden-state form) and call the loss's
functions. :func:`run_chunk` runs each through a compiled graph of its own configuration.

A *configuration* is the chunk function, the spec's maths fields (:meth:`LossSpec.maths`) and,
per tensor argument, its dtype, device type, rank, the sizes other than the row count and whether
it is contiguous. Each gets its own compiled graph with its own dynamo cache: dynamo keeps one
cache per code object and gives up on one after ``recompile_limit`` entries, so each
configuration runs a fresh copy of the chunk function's code object. Any number of
vocabularies, dtypes and option sets in one process stay compiled, and one that fails never
disables the others. The row count is dynamic (one graph serves every chunk and every step).
Inductor turns a graph's final ``copy_`` into the kernel's own store (no chunk-sized temporary).

``FUNCTIONAL_CE_COMPILE=0`` (or ``compile_chunks=False``) runs the chunk maths eagerly; so does a
Python dispatch mode (``FlopCounterMode``, a selective-checkpoint policy), where dynamo does not
compile. A configuration whose compilation fails in the compiler (dynamo, inductor, the C++ or GPU
toolchain) runs eagerly from then on, with a warning naming the cause; anything else (out of
memory, a device-side assert, bad input) propagates.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.nn.functional as F

from .spec import LossSpec

logger = logging.getLogger(__name__)


def _capped_fp32(z: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    x = z.float()
    if spec.softcap is not None:
        x = torch.tanh(x / spec.softcap) * spec.softcap
    return x


# --- cross-entropy -----------------------------------------------------------------------------


def ce_stats(z: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``[c, 2]`` (``[c, 3]`` with label smoothing) fp32: the slice's logsumexp of the (soft-capped)
    logits, the target's logit where the target lies in the slice (else 0), and the sum of the
    slice's logits (what label smoothing needs)."""
    x = _capped_fp32(z, spec)
    local = labels.long() - spec.vocab_start
    here = (labels != spec.ignore_index) & (local >= 0) & (local < x.shape[-1])
    target = x.gather(-1, torch.where(here, local, 0).unsqueeze(-1)).squeeze(-1)
    parts = [torch.logsumexp(x, dim=-1), torch.where(here, target, 0.0)]
    if spec.label_smoothing > 0.0:
        parts.append(x.sum(dim=-1))
    return torch.stack(parts, dim=-1)


def ce_rows(stats: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss ``[c]`` from the full-vocabulary statistics (0 on ignored rows), and the
    logsumexp ``[c, 1]`` its gradient needs."""
    lse, target = stats[:, 0], stats[:, 1]
    loss = lse - target
    if spec.label_smoothing > 0.0:
        eps = spec.label_smoothing
        loss = (1.0 - eps) * loss + eps * (lse - stats[:, 2] / spec.n_classes)
    if spec.z_loss > 0.0:
        loss = loss + spec.z_loss * lse * lse
    return torch.where(labels != spec.ignore_index, loss, 0.0), lse.unsqueeze(-1)


def ce_grad(z: torch.Tensor, labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
            spec: LossSpec) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss)`` w.r.t. the chunk ``z`` ``[c, V_slice]`` (its dtype),
    recomputing the softmax from the saved full-vocabulary logsumexp; zero on ignored rows."""
    x = _capped_fp32(z, spec)
    lse = saved[:, 0]
    valid = labels != spec.ignore_index
    safe = torch.where(valid, labels, 0).long()
    g = torch.where(valid, grad_rows.float(), 0.0)
    eps = spec.label_smoothing
    p_scale = g * (1.0 + 2.0 * spec.z_loss * lse) if spec.z_loss > 0.0 else g
    probs = torch.exp(x - lse.unsqueeze(-1))
    # int32 class ids (vocabularies are < 2**31): the [c, V] comparison vectorises twice as wide
    # as in int64 (10% of the compiled chunk on CPU)
    cols = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32) + spec.vocab_start
    hit = cols.unsqueeze(0) == safe.int().unsqueeze(-1)
    grad = probs * p_scale.unsqueeze(-1) - torch.where(hit, (g * (1.0 - eps)).unsqueeze(-1), 0.0)
    if eps > 0.0:
        grad = grad - (g * (eps / spec.n_classes)).unsqueeze(-1)
    if spec.softcap is not None:
        t = x / spec.softcap
        grad = grad * (1.0 - t * t)
    grad = torch.where(valid.unsqueeze(-1), grad, 0.0)
    return grad.to(z.dtype)


@dataclasses.dataclass(frozen=True)
class LossMaths:
    """The pure chunk functions of one loss (see the module docstring)."""

    stats: Callable[..., torch.Tensor]
    width: Callable[[LossSpec], int]
    combine: tuple[str, ...]
    rows: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad: Callable[..., torch.Tensor]
    #: ``(public name, what to use for double backward)`` of the logits and the hidden-state form.
    names: tuple[tuple[str, str], tuple[str, str]]


#: ``LossSpec.loss`` -> its maths.
LOSSES = {
    "cross_entropy": LossMaths(
        ce_stats, lambda spec: 3 if spec.label_smoothing > 0.0 else 2, ("lse", "sum", "sum"), ce_rows, ce_grad,
        (("cross_entropy", "torch.nn.functional.cross_entropy"),
         ("linear_cross_entropy", "F.linear + torch.nn.functional.cross_entropy")),
    ),
}


def chunk_forward(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, *, opts: LossSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp of one chunk ``[c, V]`` (all classes): fp32 ``[c]`` each,
    the loss 0 on ignored rows."""
    opts = _full_vocabulary(opts, logits_chunk)
    maths = LOSSES[opts.loss]
    loss, saved = maths.rows(maths.stats(logits_chunk, labels_chunk, opts), labels_chunk, opts)
    return loss, saved[:, 0]


def chunk_backward(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, lse: torch.Tensor,
                   grad_rows: torch.Tensor, *, opts: LossSpec) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss_rows)`` w.r.t. one chunk of logits ``[c, V]``, given the
    ``lse`` ``[c]`` of :func:`chunk_forward`; in ``logits_chunk.dtype``, zero on ignored rows."""
    opts = _full_vocabulary(opts, logits_chunk)
    return LOSSES[opts.loss].grad(logits_chunk, labels_chunk, lse.unsqueeze(-1), grad_rows, opts)


def _full_vocabulary(opts: LossSpec, logits_chunk: torch.Tensor) -> LossSpec:
    """``opts`` for a chunk holding every class (``n_classes`` from the chunk when not given)."""
    return opts if opts.n_classes is not None else dataclasses.replace(opts, n_classes=logits_chunk.shape[-1])


# --- the graphs the driver runs per chunk ------------------------------------------------------


def _logits(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], spec: LossSpec
            ) -> torch.Tensor:
    return x if spec.form == "logits" else F.linear(x, weight, bias)


def forward_into(out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], labels: torch.Tensor, *, opts: LossSpec) -> None:
    """The statistics ``[c, k]`` of one chunk of rows (logits, or hidden states), into ``out``."""
    out.copy_(LOSSES[opts.loss].stats(_logits(x, weight, bias, opts), labels, opts))


def backward_into(out: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, saved: torch.Tensor,
                  grad_rows: torch.Tensor, *, opts: LossSpec) -> None:
    """The logits' gradient ``[c, V]`` of one chunk, into ``out`` (which may be ``logits`` itself)."""
    out.copy_(LOSSES[opts.loss].grad(logits, labels, saved, grad_rows, opts))


def linear_backward_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor, *, opts: LossSpec
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute one chunk's logits; return ``(grad_hidden [c, H], grad_logits [c, V])`` in the
    input dtype (the driver folds ``grad_logits`` into the weight and bias gradients)."""
    grad_logits = LOSSES[opts.loss].grad(F.linear(hidden, weight, bias), labels, saved, grad_rows, opts)
    return grad_logits @ weight, grad_logits


def linear_fused_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       labels: torch.Tensor, coef: torch.Tensor, *, opts: LossSpec
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of the whole vocabulary with its gradients in forward: ``(loss fp32 [c],
    grad_hidden [c, H], grad_logits [c, V])`` of ``sum(coef * loss)``, the logits built once."""
    maths = LOSSES[opts.loss]
    logits = F.linear(hidden, weight, bias)
    loss, saved = maths.rows(maths.stats(logits, labels, opts), labels, opts)
    grad_logits = maths.grad(logits, labels, saved, coef, opts)
    return loss, grad_logits @ weight, grad_logits


def accumulate_into(acc: torch.Tensor, partial: torch.Tensor, *, opts: LossSpec) -> None:
    """``acc [r, H] fp32 += partial [r, H]`` (low precision) in one pass (``opts`` unused)."""
    acc.add_(partial.to(acc.dtype))


def copy_into(out: torch.Tensor, src: torch.Tensor, *, opts: LossSpec) -> None:
    """``out [r, H] = src`` converted to ``out``'s dtype in one pass (``opts`` unused)."""
    out.copy_(src)


# --- compiled graphs, one per configuration ----------------------------------------------------

#: Configuration key -> ``(compiled callable, its own copy of the chunk function)``, or None
#: once compiling that configuration failed.
_graphs: dict[Hashable, Optional[tuple[Callable, Callable]]] = {}


def compile_by_default() -> bool:
    """Whether eager calls use compiled chunk graphs when the caller does not say."""
    return os.environ.get("FUNCTIONAL_CE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def _in_dispatch_mode() -> bool:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return torch._C._len_torch_dispatch_stack() > 0 or is_in_torch_dispatch_mode(include_infra_modes=False)


def _describe(t: Any, is_rows: bool) -> Hashable:
    if not isinstance(t, torch.Tensor):
        return None if t is None else type(t).__name__
    sizes = tuple(t.shape[1:]) if is_rows else tuple(t.shape)
    return (t.dtype, t.device.type, t.dim(), sizes, t.is_contiguous())


def configuration_key(fn: Callable, args: Sequence[Any], row_args: Sequence[int], opts: LossSpec) -> Hashable:
    """What a compiled chunk graph specialises on (see the module docstring)."""
    return (fn.__module__, fn.__qualname__, opts) + tuple(_describe(a, i in row_args) for i, a in enumerate(args))


def _fresh_copy(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, hence a dynamo cache of its own."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _is_compiler_failure(exc: BaseException) -> bool:
    """True for errors of the compiler itself; False if anything in the chain is out of memory
    or a device error, which must reach the caller."""
    from torch._dynamo import exc as dynamo_exc
    from torch._inductor import exc as inductor_exc

    seen: set[int] = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, (torch.OutOfMemoryError, MemoryError)) or type(cause).__name__ == "AcceleratorError":
            return False
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    compiler_errors = (
        dynamo_exc.TorchDynamoException, dynamo_exc.FailOnRecompileLimitHit, inductor_exc.OperatorIssue,
        inductor_exc.SubgraphLoweringException, inductor_exc.InvalidCxxCompiler, inductor_exc.CppCompileError,
        inductor_exc.CppWrapperCodegenError,
    )
    return isinstance(exc, compiler_errors)


def _root_cause(exc: BaseException) -> str:
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    shown = inner if inner is not None else exc
    first = (str(shown).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {type(shown).__name__}: {first}" if shown is not exc else f"{type(exc).__name__}: {first}"


def run_chunk(fn: Callable, spec: LossSpec, *args: Any, row_args: Sequence[int]) -> Any:
    """``fn(*args, opts=spec.maths())``, through the compiled graph of its configuration when
    ``spec.compile_chunks`` (None: ``FUNCTIONAL_CE_COMPILE``) asks and it is possible.

    ``row_args`` are the positions in ``args`` of tensors whose first dim is the chunk's row count
    (it varies between chunks and steps, and is marked dynamic).
    """
    opts = spec.maths()
    use_compiled = compile_by_default() if spec.compile_chunks is None else spec.compile_chunks
    if not use_compiled or torch.compiler.is_compiling() or _in_dispatch_mode():
        return fn(*args, opts=opts)
    key = configuration_key(fn, args, row_args, opts)
    entry = _graphs.get(key, ...)
    if entry is None:  # compiling this configuration failed before
        return fn(*args, opts=opts)
    if entry is ...:
        copy = _fresh_copy(fn)
        entry = _graphs[key] = (torch.compile(copy, dynamic=False, fullgraph=True), copy)
    for i in row_args:
        torch._dynamo.maybe_mark_dynamic(args[i], 0)
    try:
        return entry[0](*args, opts=opts)
    except Exception as exc:
        if not _is_compiler_failure(exc):
            raise
        _graphs[key] = None
        logger.warning(
            "functional_ce: compiling the chunk graph %s for %s failed in the compiler (%s); this "
            "configuration runs eagerly from now on. Set FUNCTIONAL_CE_COMPILE=0 to skip compiling.",
            fn.__name__, opts, _root_cause(exc),
        )
        return fn(*args, opts=opts)


def compiled_configurations() -> dict[Hashable, int]:
    """Every configuration seen so far in this process -> how many compiled graphs dynamo holds
    for it (0: it runs eagerly, after a compiler failure or a ``torch._dynamo.reset()``)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {
        key: 0 if entry is None else len(_debug_get_cache_entry_list(entry[1].__code__))
        for key, entry in _graphs.items()
    }
