"""Measure a ``dist`` variant on fresh processes, one per rank, from the bench process.

Each rank runs :mod:`bench.dist_worker` (gloo on CPU, one process per GPU with nccl on CUDA; a
world larger than the GPU count is reported as skipped). The variant's measurement holds the
largest figures over ranks: step time, peak extra memory and the bytes handed to collectives in
forward and in backward, with every rank's own in ``extra["ranks"]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

from .dist_worker import MARK
from .measure import Measurement, child_env


def launch(setup: str, kwargs: dict[str, Any], *, world: int, device: str, repeats: int,
           timeout: float = 900.0) -> Measurement:
    """Run ``setup`` on ``world`` fresh processes; the largest per-rank figures, with every rank's
    in ``extra["ranks"]``."""
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        return Measurement(error=f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        spec = {"setup": setup, "kwargs": kwargs, "device": device, "world_size": world, "warmup": 1,
                "repeats": repeats, "init_file": os.path.join(tmp, "rendezvous")}
        env = child_env()
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [
            subprocess.Popen([sys.executable, "-m", "bench.dist_worker", json.dumps(spec), str(r)],
                             stdout=logs[r], stderr=subprocess.STDOUT, text=True, env=env)
            for r in range(world)
        ]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return Measurement(error=f"timed out after {timeout:.0f} s")
        ranks, failure = [], None
        for r, log in enumerate(logs):
            log.seek(0)
            lines = log.read().splitlines()
            log.close()
            found = [json.loads(x[len(MARK):]) for x in lines if x.startswith(MARK)]
            if found:
                ranks.append(found[0])
            elif failure is None:
                failure = f"rank {r}: " + ((lines[-1:] or [f"exit code {procs[r].returncode}"])[0][:200])
    if failure:
        return Measurement(error=failure)
    peaks = [r["peak_extra_bytes"] for r in ranks]
    spreads = [r.get("spread") for r in ranks]
    return Measurement(
        seconds=max(r["seconds"] for r in ranks),
        peak_extra_bytes=None if None in peaks else max(peaks),
        spread=None if None in spreads else max(spreads),
        extra={"forward_bytes": max(r["forward_bytes"] for r in ranks),
               "backward_bytes": max(r["backward_bytes"] for r in ranks), "ranks": ranks},
    )

