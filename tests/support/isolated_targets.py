"""Functions the tests of :mod:`bench.harness.isolated` run in its child processes. This module imports
nothing beyond the standard library, so what a child finds imported, the server imported."""

from __future__ import annotations

import sys


def imported(name: str) -> bool:
    """Whether ``name`` was in ``sys.modules`` when this child started."""
    return name in sys.modules


def mmap_threshold_env() -> str | None:
    """What glibc read for its mmap threshold when the process started (the server's environment)."""
    with open("/proc/self/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}.get("MALLOC_MMAP_THRESHOLD_")
