"""One rank of a ``dist`` bench measurement: ``python -m bench.dist_worker '<json>' RANK``.

Every rank joins one process group (gloo on CPU, nccl on CUDA, rendezvous through a file),
builds a 1-D device mesh over all ranks, and runs the variant's setup, which returns
``(forward, backward)``: ``forward()`` gives the loss, ``backward(loss)`` backpropagates it.
After a warm-up step, the rank times ``repeats`` steps and records its peak extra memory (CUDA
``max_memory_allocated``, or the peak resident set on CPU, as :mod:`bench.measure` does), then
runs one more step under :class:`tests.support.comm_bytes.CommBytes` to count the bytes it hands to
collectives in forward and in backward (eager: the counter keeps dynamo from compiling).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests.support.comm_bytes import CommBytes
from tests.support.rss_peak import reset_peak_rss, rss_bytes

from .measure import spread_of

MARK = "BENCH-RANK-RESULT "


@dataclasses.dataclass
class RankMeasurement:
    rank: int
    seconds: float
    peak_extra_bytes: int | None
    forward_bytes: int
    backward_bytes: int
    by_op: dict[str, int]
    spread: float | None = None


def _run(spec: dict[str, Any], rank: int) -> RankMeasurement:
    world = spec["world_size"]
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{spec['init_file']}", rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    module, name = spec["setup"].split(":")
    setup: Callable[..., tuple[Callable, Callable]] = getattr(importlib.import_module(module), name)
    forward, backward = setup(mesh=mesh, **spec["kwargs"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(spec["warmup"]):
        backward(forward())
    sync()
    dist.barrier()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_bytes("VmRSS") if reset_peak_rss() else None
    times = []
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        backward(forward())
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = None if before is None else rss_bytes("VmHWM") - before
    with CommBytes() as fwd:
        loss = forward()
    with CommBytes() as bwd:
        backward(loss)
    by_op = {f"forward {k}": v for k, v in fwd.by_op.items()} | {f"backward {k}": v for k, v in bwd.by_op.items()}
    dist.barrier()
    dist.destroy_process_group()
    return RankMeasurement(rank, statistics.median(times), peak, fwd.bytes, bwd.bytes, by_op, spread_of(times))


if __name__ == "__main__":
    result = _run(json.loads(sys.argv[1]), int(sys.argv[2]))
    print(MARK + json.dumps(dataclasses.asdict(result)), flush=True)
