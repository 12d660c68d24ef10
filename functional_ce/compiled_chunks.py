"""How the per-chunk graphs run: each configuration through a compiled graph of its own.

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

import logging
import os
import types
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .spec import LossSpec

logger = logging.getLogger(__name__)

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
        if args[i] is not None:
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
