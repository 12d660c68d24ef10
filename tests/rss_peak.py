"""Peak resident memory of a call, in this process, for allocations no dispatch mode can see
(inside inductor-compiled graphs).

glibc is told to serve every block of 64 KiB or more by ``mmap`` and to return it on ``free``,
so each transient buffer shows in the resident set; the kernel's high-water mark (``VmHWM``) is
reset before the call through ``/proc/self/clear_refs``. Linux with glibc only: elsewhere the
tests that use this skip.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any, Callable

import pytest

_M_MMAP_THRESHOLD = -3


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def _prepare() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) == 1
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status("VmHWM")
    except OSError as exc:
        pytest.skip(f"peak resident memory cannot be measured here: {exc}")
    if not ok:
        pytest.skip("glibc refused the mmap threshold: transient buffers would be hidden")


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), highest resident set during the call minus the resident set before it)``."""
    _prepare()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before
