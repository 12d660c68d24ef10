"""One rank of a ``dist`` bench measurement (:func:`run_rank`, in a process of its own).

Every rank joins one process group (gloo on CPU, nccl on CUDA, rendezvous through a file),
builds a 1-D device mesh over all ranks, and runs the variant's setup, which returns
``(forward, backward)``: ``forward()`` gives the loss, ``backward(loss)`` backpropagates it.
After a warm-up step and a barrier, the rank times ``repeats`` steps and records its peak extra
memory (:func:`bench.harness.measure.time_step`: CUDA ``max_memory_allocated``, or the peak resident set
on CPU), then runs one more step under :class:`bench.harness.comm_bytes.CommBytes` to count the bytes it
hands to collectives in forward and in backward (eager: the counter keeps dynamo from compiling).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.harness.comm_bytes import CommBytes
from bench.harness.isolated import resolve
from bench.harness.measure import time_step


@dataclasses.dataclass
class RankMeasurement:
    rank: int
    seconds: float
    peak_extra_bytes: int | None
    forward_bytes: int
    backward_bytes: int
    by_op: dict[str, int]
    spread: float | None = None


def run_rank(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s :class:`RankMeasurement`, as a dict (the launcher needs no import of this module)."""
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
    setup: Callable[..., tuple[Callable, Callable]] = resolve(spec["setup"])
    forward, backward = setup(mesh=mesh, **spec["kwargs"])
    timed = time_step(lambda: backward(forward()), device=spec["device"], warmup=spec["warmup"],
                      repeats=spec["repeats"], after_warmup=dist.barrier)
    with CommBytes() as fwd:
        loss = forward()
    with CommBytes() as bwd:
        backward(loss)
    by_op = {f"forward {k}": v for k, v in fwd.by_op.items()} | {f"backward {k}": v for k, v in bwd.by_op.items()}
    dist.barrier()
    dist.destroy_process_group()
    return dataclasses.asdict(RankMeasurement(rank, timed.seconds, timed.peak_extra_bytes, fwd.bytes, bwd.bytes, by_op,
                                              timed.spread))
