"""The process's resident set and its high-water mark (Linux), the CPU memory figure of the report.

Freed memory leaves the resident set only when glibc returns it to the kernel: a block served by
``mmap`` is unmapped at ``free``, and glibc serves by ``mmap`` from ``MALLOC_MMAP_THRESHOLD_``
up. :mod:`bench.harness.isolated` fixes that threshold at :data:`MMAP_THRESHOLD` in every measuring
process (glibc's default, 128 KiB, grows with every freed mapping, after which freed activations
stay in the heap and later allocations reuse them unseen).
"""

from __future__ import annotations

#: glibc's mmap threshold in the measuring processes, in bytes.
MMAP_THRESHOLD = 64 * 1024


def rss_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident set; False where the kernel does not allow it
    (Linux >= 4.0 does)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
