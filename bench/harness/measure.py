"""Time and peak extra memory of one training step, each variant in its own process.

A variant is a setup function (module level, passed as itself) that takes keyword arguments, builds
its inputs and returns a zero-argument ``step`` callable (one forward + backward). The child
process warms the step up (compilation stays out of the timing), then measures:

- time: median wall-clock seconds of ``repeats`` steps (CUDA synchronised), and their spread
  ``(max - min) / median`` (the run-to-run noise ``python -m bench --compare`` judges moves by);
- peak extra memory: on CUDA, ``max_memory_allocated`` during the timed steps minus what was
  allocated before them; on CPU, the peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs``) minus the resident set before them (Linux only; glibc is told
  to map every block of 64 KiB or more on its own, so no freed memory is silently reused).

:func:`measure` runs :func:`run_spec` in a fresh process (:mod:`bench.harness.isolated`, which also sets
glibc's threshold); ``python -m bench.harness.measure '<json>'`` runs one by hand. :func:`time_step` is the
measurement itself, in the calling process (each ``dist`` rank's too).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional

from bench.harness import isolated
from bench.harness.rss import reset_peak_rss, rss_bytes


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
    setup: Callable[..., Callable[[], Any]], kwargs: dict[str, Any], *, device: str = "cpu", warmup: int = 1, repeats: int = 3,
    timeout: float = 600.0,
) -> Measurement:
    """Measure the variant ``setup`` (a module-level function) with ``kwargs`` in a fresh process
    (:mod:`bench.harness.isolated`)."""
    spec = {"setup": isolated.reference(setup), "kwargs": kwargs, "device": device, "warmup": warmup, "repeats": repeats}
    try:
        return isolated.call(run_spec, spec, timeout=timeout)
    except isolated.WorkerFailed as exc:
        return Measurement(error=str(exc)[:200])


def time_step(step: Callable[[], Any], *, device: str, warmup: int, repeats: int,
              after_warmup: Callable[[], Any] = lambda: None) -> Measurement:
    """Time ``step`` in this process: ``warmup`` untimed steps (then ``after_warmup()``, e.g. a
    barrier between ranks), then the median and spread of ``repeats`` timed steps (CUDA
    synchronised) and the peak extra memory during them (see the module's docs)."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    after_warmup()
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
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        # the kernel batches each thread's resident-set counts (up to 64 pages a thread), so two
        # readings can differ by a few hundred KiB either way: a step that adds nothing can read
        # slightly negative, which is reported as 0
        peak = None if before is None else max(0, rss_bytes("VmHWM") - before)
    return Measurement(seconds=statistics.median(times), peak_extra_bytes=peak, spread=spread_of(times))


def run_spec(spec: dict[str, Any]) -> Measurement:
    """What :func:`measure` runs in its child process."""
    setup: Callable[..., Callable[[], Any]] = isolated.resolve(spec["setup"])
    step = setup(device=spec["device"], **spec["kwargs"])
    return time_step(step, device=spec["device"], warmup=spec["warmup"], repeats=spec["repeats"])


def spread_of(times: list[float]) -> Optional[float]:
    """``(max - min) / median`` of repeated timings; None with fewer than 2 (or a zero median)."""
    if len(times) < 2:
        return None
    mid = statistics.median(times)
    return (max(times) - min(times)) / mid if mid > 0 else None


if __name__ == "__main__":  # by hand: python -m bench.harness.measure '{"setup": ..., "kwargs": ...}'
    print(json.dumps(dataclasses.asdict(run_spec(json.loads(sys.argv[1])))), flush=True)
