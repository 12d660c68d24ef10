"""Compiled per-chunk graphs for eager calls: one graph per configuration, eager only on a
genuine compiler failure.

Both loss forms call their chunk functions through :func:`run_chunk`. A *configuration* is
the chunk function, the :class:`~functional_ce.options.ChunkOptions` and, per tensor argument,
its dtype, device type, rank, the sizes other than the row count and whether it is contiguous.
Each configuration gets its own compiled graph with its own dynamo cache: dynamo keeps one cache
per code object and gives up on a code object after ``recompile_limit`` entries, so each
configuration runs a fresh copy of the chunk function's code object. Any number of vocabularies,
dtypes and option sets in one process therefore stay compiled, and one that fails never disables
the others. The row count is dynamic (one graph serves every chunk, the tail and every step).

The logits form's backward graph writes straight into the caller's buffer (the gradient, or the
logits themselves for ``inplace_grad``): inductor turns the final ``copy_`` into the kernel's own
store, so no chunk-sized temporary is allocated and copied.

Set ``FUNCTIONAL_CE_COMPILE=0`` (or pass ``compile_chunks=False``) to run the chunk maths eagerly.
Under a Python dispatch mode (``FlopCounterMode``, a selective-checkpoint policy, a debug mode),
where dynamo does not compile, the chunk maths runs eagerly too.
If compiling a configuration fails in the compiler (dynamo, inductor, the C++ or GPU toolchain),
that configuration runs eagerly from then on and a warning names the cause. Anything else (out of
memory, a device-side assert, bad input) propagates.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .chunk import chunk_backward, chunk_forward, chunk_stats
from .options import ChunkOptions

logger = logging.getLogger(__name__)

#: Configuration key -> ``(compiled callable, its own copy of the chunk function)``, or None
#: once compiling that configuration failed.
_graphs: dict[Hashable, Optional[tuple[Callable, Callable]]] = {}


def compile_by_default() -> bool:
    """Whether eager calls use compiled chunk graphs when the caller does not say."""
    return os.environ.get("FUNCTIONAL_CE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def forward_into(
    loss_out: torch.Tensor, lse_out: torch.Tensor, logits_chunk: torch.Tensor, labels_chunk: torch.Tensor,
    *, opts: ChunkOptions,
) -> None:
    """:func:`~functional_ce.chunk.chunk_forward` of one chunk, written into ``loss_out`` / ``lse_out`` ``[c]``."""
    loss, lse = chunk_forward(logits_chunk, labels_chunk, opts=opts)
    loss_out.copy_(loss)
    lse_out.copy_(lse)


def stats_into(
    lse_out: torch.Tensor, target_out: torch.Tensor, total_out: torch.Tensor, logits_chunk: torch.Tensor,
    labels_chunk: torch.Tensor, *, opts: ChunkOptions,
) -> None:
    """:func:`~functional_ce.chunk.chunk_stats` of one chunk of a vocabulary slice, written into
    three ``[c]`` fp32 outputs."""
    lse, target, total = chunk_stats(logits_chunk, labels_chunk, opts=opts)
    lse_out.copy_(lse)
    target_out.copy_(target)
    total_out.copy_(total)


def backward_into(
    out: torch.Tensor, logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, lse: torch.Tensor,
    grad_rows: torch.Tensor, *, opts: ChunkOptions,
) -> None:
    """:func:`~functional_ce.chunk.chunk_backward` of one chunk, written into ``out`` ``[c, V]``
    (which may be ``logits_chunk`` itself)."""
    out.copy_(chunk_backward(logits_chunk, labels_chunk, lse, grad_rows, opts=opts))


def accumulate_into(acc: torch.Tensor, partial: torch.Tensor, *, opts: ChunkOptions) -> None:
    """``acc [r, H] fp32 += partial [r, H]`` (low precision) in one pass; ``opts`` is unused
    (the weight-gradient fold depends on no loss option)."""
    acc.add_(partial.to(acc.dtype))


def copy_into(out: torch.Tensor, src: torch.Tensor, *, opts: ChunkOptions) -> None:
    """``out [r, H] = src [r, H]`` converted to ``out``'s dtype in one pass (a low-precision
    partial into the fp32 accumulator, or the accumulator into the returned gradient); ``opts``
    is unused."""
    out.copy_(src)


def _in_dispatch_mode() -> bool:
    """A Python dispatch mode is active (FlopCounterMode, a selective-checkpoint policy, a memory
    trace...): dynamo does not compile under one, so the chunk maths runs eagerly there."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return torch._C._len_torch_dispatch_stack() > 0 or is_in_torch_dispatch_mode(include_infra_modes=False)


def _describe(t: Any, is_rows: bool) -> Hashable:
    if not isinstance(t, torch.Tensor):
        return None if t is None else type(t).__name__
    sizes = tuple(t.shape[1:]) if is_rows else tuple(t.shape)
    return (t.dtype, t.device.type, t.dim(), sizes, t.is_contiguous())


def configuration_key(fn: Callable, args: Sequence[Any], row_args: Sequence[int], opts: ChunkOptions) -> Hashable:
    """What a compiled chunk graph specialises on (see the module docstring)."""
    return (fn.__module__, fn.__qualname__, opts) + tuple(
        _describe(a, i in row_args) for i, a in enumerate(args)
    )


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


def run_chunk(
    fn: Callable, compile_chunks: Optional[bool], *args: Any, row_args: Sequence[int], opts: ChunkOptions
) -> Any:
    """``fn(*args, opts=opts)``, through the compiled graph of its configuration when asked and possible.

    Args:
        fn: a pure chunk function (:func:`forward_into`, :func:`backward_into`, or the
            hidden-state form's chunk functions).
        compile_chunks: True / False, or None to follow ``FUNCTIONAL_CE_COMPILE``.
        args: the chunk function's tensor (or None) arguments.
        row_args: positions in ``args`` of tensors whose first dim is the chunk's row count,
            which varies between chunks and steps; it is marked dynamic.
        opts: the loss options, a compile-time constant of the graph.
    """
    use_compiled = compile_by_default() if compile_chunks is None else compile_chunks
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
