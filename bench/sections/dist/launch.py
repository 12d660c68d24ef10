"""Measure a ``dist`` variant on fresh processes, one per rank, from the bench process.

Each rank runs :func:`bench.sections.dist.worker.run_rank` in a fresh process (:mod:`bench.harness.isolated`;
gloo on CPU, one process per GPU with nccl on CUDA; a world larger than the GPU count is
reported as skipped). The variant's measurement holds the largest figures over ranks: step
time, peak extra memory and the bytes handed to collectives in forward and in backward, with
every rank's own in ``extra["ranks"]``.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import torch

from bench.harness import isolated
from bench.harness.measure import Measurement
from bench.sections.dist.worker import run_rank


def launch(setup: Callable[..., Any], kwargs: dict[str, Any], *, world: int, device: str, repeats: int,
           timeout: float = 900.0) -> Measurement:
    """Run ``setup`` on ``world`` fresh processes; the largest per-rank figures, with every rank's
    in ``extra["ranks"]``."""
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        return Measurement(error=f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        spec = {"setup": isolated.reference(setup), "kwargs": kwargs, "device": device, "world_size": world, "warmup": 1,
                "repeats": repeats, "init_file": os.path.join(tmp, "rendezvous")}
        workers = [isolated.Worker(run_rank, spec, r) for r in range(world)]
        deadline = time.monotonic() + timeout
        ranks = []
        for r, worker in enumerate(workers):
            try:
                ranks.append(worker.result(max(0.0, deadline - time.monotonic())))
            except isolated.WorkerFailed as exc:
                for w in workers:
                    w.close()
                return Measurement(error=f"rank {r}: {exc}"[:200])
    peaks = [r["peak_extra_bytes"] for r in ranks]
    spreads = [r.get("spread") for r in ranks]
    return Measurement(
        seconds=max(r["seconds"] for r in ranks),
        peak_extra_bytes=None if None in peaks else max(peaks),
        spread=None if None in spreads else max(spreads),
        extra={"forward_bytes": max(r["forward_bytes"] for r in ranks),
               "backward_bytes": max(r["backward_bytes"] for r in ranks), "ranks": ranks},
    )

