"""Peak resident memory of a call, in this process, for allocations no dispatch mode can see
(inside inductor-compiled graphs), with the readings of :mod:`bench.harness.rss`.

glibc is told to serve every block of 64 KiB or more by ``mmap`` and to return it on ``free``,
so each transient buffer shows in the resident set (what :mod:`bench.harness.isolated` does for its child
processes through ``MALLOC_MMAP_THRESHOLD_``); the kernel's high-water mark is reset before the
call. Linux with glibc only: elsewhere the tests that use this skip.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any, Callable

from bench.harness.rss import reset_peak_rss, rss_bytes

_M_MMAP_THRESHOLD = -3


def _prepare() -> None:
    """Skip the calling test where the resident-set peak cannot be measured."""
    import pytest

    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024) == 1
        rss_bytes("VmHWM")
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"peak resident memory cannot be measured here: {exc}")
    if not ok or not reset_peak_rss():
        pytest.skip("this kernel or libc does not let the resident-set peak be measured")


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), highest resident set during the call minus the resident set before it)``."""
    _prepare()
    gc.collect()
    reset_peak_rss()
    before = rss_bytes("VmRSS")
    out = fn()
    return out, rss_bytes("VmHWM") - before
