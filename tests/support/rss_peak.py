"""Peak resident memory of a call, in this process, for allocations no dispatch mode can see
(inside inductor-compiled graphs); also the two readings ``bench.measure`` takes of its child
processes (:func:`rss_bytes`, :func:`reset_peak_rss`).

glibc is told to serve every block of 64 KiB or more by ``mmap`` and to return it on ``free``,
so each transient buffer shows in the resident set (what ``bench.measure`` does for its child
processes through ``MALLOC_MMAP_THRESHOLD_``); the kernel's high-water mark is reset before the
call. Linux with glibc only: elsewhere the tests that use this skip.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any, Callable

_M_MMAP_THRESHOLD = -3


def rss_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident set; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
