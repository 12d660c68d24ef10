"""Compiled versions of the per-chunk functions, used by eager calls, with an eager fallback.

The backward graph writes its result straight into the caller's buffer (the gradient, or the
logits themselves for ``inplace_grad``): inductor turns the final ``copy_`` into the kernel's
own store, so no chunk-sized temporary is allocated and copied.

Set ``FUNCTIONAL_CE_COMPILE=0`` (or pass ``compile_chunks=False``) to run the chunk maths
eagerly. If torch.compile is unavailable or fails, the eager functions are used and a warning
is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional, Sequence

import torch

from .chunk import chunk_backward, chunk_forward
from .options import ChunkOptions

logger = logging.getLogger(__name__)

_broken: set[str] = set()


def compile_by_default() -> bool:
    """Whether eager calls use compiled chunk graphs when the caller does not say."""
    return os.environ.get("FUNCTIONAL_CE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def compile_flag(compile_chunks: int) -> Optional[bool]:
    """Operator-argument form of ``compile_chunks``: -1 follows the environment, 0 eager, 1 compiled."""
    return None if compile_chunks < 0 else bool(compile_chunks)


def _forward_into(
    loss_out: torch.Tensor, lse_out: torch.Tensor, logits_chunk: torch.Tensor, labels_chunk: torch.Tensor,
    *, opts: ChunkOptions,
) -> None:
    loss, lse = chunk_forward(logits_chunk, labels_chunk, opts=opts)
    loss_out.copy_(loss)
    lse_out.copy_(lse)


def _backward_into(
    out: torch.Tensor, logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, lse: torch.Tensor,
    grad_rows: torch.Tensor, *, opts: ChunkOptions,
) -> None:
    out.copy_(chunk_backward(logits_chunk, labels_chunk, lse, grad_rows, opts=opts))


_EAGER: dict[str, Callable[..., None]] = {"forward": _forward_into, "backward": _backward_into}


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


def call_compiled(
    fn: Callable, compile_chunks: Optional[bool], *args, row_tensors: Sequence[torch.Tensor] = (), **kwargs
):
    """``fn(*args, **kwargs)``, through a compiled graph when asked and possible.

    ``compile_chunks``: True / False, or None to follow ``FUNCTIONAL_CE_COMPILE``.
    ``row_tensors``: tensors whose first dim is the chunk's row count, which varies between
    chunks (the tail) and steps: marked dynamic so one graph serves all of them. If compiling
    fails, ``fn`` runs eagerly from then on and a warning is logged once.
    """
    use_compiled = compile_by_default() if compile_chunks is None else compile_chunks
    if not use_compiled or fn.__name__ in _broken or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    for t in row_tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        return _compiled(fn)(*args, **kwargs)
    except Exception as exc:  # a missing compiler, an unsupported platform, ...
        _broken.add(fn.__name__)
        logger.warning(
            "functional_ce: compiling %s failed (%s: %s); using the eager function. "
            "Set FUNCTIONAL_CE_COMPILE=0 to skip the attempt.",
            fn.__name__, type(exc).__name__, (str(exc).splitlines() or [""])[0],
        )
        return fn(*args, **kwargs)


def run_chunk(name: str, compile_chunks: Optional[bool], *args: torch.Tensor, opts: ChunkOptions) -> None:
    """Run the ``"forward"`` or ``"backward"`` chunk graph of the logits form.

    ``forward``: ``(loss_out [c], lse_out [c], logits_chunk [c, V], labels_chunk [c])``.
    ``backward``: ``(out [c, V], logits_chunk [c, V], labels_chunk [c], lse [c], grad_rows [c])``;
    ``out`` may be ``logits_chunk`` itself (in-place gradient).
    """
    call_compiled(_EAGER[name], compile_chunks, *args, row_tensors=args, opts=opts)
