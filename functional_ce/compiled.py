"""Compiled versions of the per-chunk functions, used by eager calls, with an eager fallback.

Set ``FUNCTIONAL_CE_COMPILE=0`` (or pass ``compile_chunks=False``) to run the chunk maths
eagerly. If torch.compile is unavailable or fails, the eager functions are used and a warning
is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import torch

from .chunk import chunk_backward, chunk_forward

logger = logging.getLogger(__name__)

_broken: set[str] = set()


def compile_by_default() -> bool:
    """Whether eager calls use compiled chunk graphs when the caller does not say."""
    return os.environ.get("FUNCTIONAL_CE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def _compiled(name: str) -> Callable:
    fn = {"forward": chunk_forward, "backward": chunk_backward}[name]
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _mark_rows_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def run_chunk(name: str, compile_chunks: Optional[bool], *args, **kwargs):
    """Run ``chunk_forward`` or ``chunk_backward`` (``name``), compiled when asked and possible."""
    fn = chunk_forward if name == "forward" else chunk_backward
    use_compiled = compile_by_default() if compile_chunks is None else compile_chunks
    if not use_compiled or name in _broken or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    # Row count varies between chunks (the tail) and steps: one graph serves all of them.
    _mark_rows_dynamic(*(a for a in args if isinstance(a, torch.Tensor)))
    try:
        return _compiled(name)(*args, **kwargs)
    except Exception as exc:  # a missing compiler, an unsupported platform, ...
        _broken.add(name)
        logger.warning(
            "functional_ce: compiling chunk_%s failed (%s: %s); using the eager chunk function. "
            "Set FUNCTIONAL_CE_COMPILE=0 to skip the attempt.",
            name,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return fn(*args, **kwargs)
