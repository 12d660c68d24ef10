"""Time and peak extra memory of one training step, each variant in its own process.

A variant is a setup function named ``"module:function"`` that takes keyword arguments, builds
its inputs and returns a zero-argument ``step`` callable (one forward + backward). The child
process warms the step up (compilation stays out of the timing), then measures:

- time: median wall-clock seconds of ``repeats`` steps (CUDA synchronised), and their spread
  ``(max - min) / median`` (the run-to-run noise ``python -m bench --compare`` judges moves by);
- peak extra memory: on CUDA, ``max_memory_allocated`` during the timed steps minus what was
  allocated before them; on CPU, the peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs``) minus the resident set before them (Linux only; glibc is told
  to map every block of 64 KiB or more on its own, so no freed memory is silently reused).

Run as ``python -m bench.measure '<json>'``; :func:`measure` does that and parses the answer.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from tests.support.rss_peak import reset_peak_rss, rss_bytes

_MARK = "BENCH-RESULT "


@dataclasses.dataclass
class Measurement:
    """What one variant's child process reported; ``error`` is set when it failed."""

    seconds: Optional[float] = None
    peak_extra_bytes: Optional[int] = None
    error: Optional[str] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``(max - min) / median`` of the timed steps; None with fewer than 2.
    spread: Optional[float] = None

    @property
    def ms(self) -> Optional[float]:
        return None if self.seconds is None else self.seconds * 1e3

    @property
    def peak_mib(self) -> Optional[float]:
        return None if self.peak_extra_bytes is None else self.peak_extra_bytes / 2**20


def measure(
    setup: str, kwargs: dict[str, Any], *, device: str = "cpu", warmup: int = 1, repeats: int = 3,
    timeout: float = 600.0,
) -> Measurement:
    """Measure the variant ``setup`` (``"module:function"``) with ``kwargs`` in a fresh process."""
    spec = {"setup": setup, "kwargs": kwargs, "device": device, "warmup": warmup, "repeats": repeats}
    env = dict(os.environ)
    # glibc: serve every block >= 64 KiB by mmap and return it on free, so the resident set
    # sees each transient buffer (the default threshold adapts upward and would let freed
    # warm-up memory hide later allocations).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lean-llm-train-inductor"))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.measure", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        return Measurement(error=f"timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return Measurement(**json.loads(line[len(_MARK):]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return Measurement(error=tail[0][:200])


def _run(spec: dict[str, Any]) -> Measurement:
    import torch

    module, name = spec["setup"].split(":")
    setup: Callable[..., Callable[[], Any]] = getattr(importlib.import_module(module), name)
    device = spec["device"]
    cuda = device.startswith("cuda")
    step = setup(device=device, **spec["kwargs"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(spec["warmup"]):
        step()
    sync()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        # the high-water mark right after its reset is the resident set it started from: reading
        # VmRSS first instead could see pages that are released before the reset (a negative peak)
        before = rss_bytes("VmHWM") if reset_peak_rss() else None
    times = []
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = None if before is None else rss_bytes("VmHWM") - before
    return Measurement(seconds=statistics.median(times), peak_extra_bytes=peak, spread=spread_of(times))


def spread_of(times: list[float]) -> Optional[float]:
    """``(max - min) / median`` of repeated timings; None with fewer than 2 (or a zero median)."""
    if len(times) < 2:
        return None
    mid = statistics.median(times)
    return (max(times) - min(times)) / mid if mid > 0 else None


if __name__ == "__main__":
    result = _run(json.loads(sys.argv[1]))
    print(_MARK + json.dumps(dataclasses.asdict(result)), flush=True)
