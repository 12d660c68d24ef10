"""A pool of gloo CPU processes that a test module shares: spawned once, one process group.

Spawning processes and creating a process group takes seconds, so a test module starts one
:class:`DistPool` (``world_size`` processes, default 4) in a module-scoped fixture and sends it
tasks. A task is a module-level function ``fn(mesh, *args)``; every process runs it (processes
outside ``mesh`` get ``mesh=None``) and :meth:`DistPool.run` returns the per-rank results, or
raises the first rank's exception with its traceback (:func:`dist_pool_fixture` makes that
fixture). Meshes smaller than the world (2 or 3 ranks, 2-D shapes) are created once per shape
on every process, as DeviceMesh requires.

Each process runs one intra-op thread (the machine's cores are shared by all ranks) and the
chunk maths eagerly unless a task turns compiling on.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Iterator, Optional

import torch
import torch.multiprocessing as mp

TASK_TIMEOUT_S = 300.0


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    os.environ.setdefault("FUNCTIONAL_CE_COMPILE", "0")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    meshes: dict[tuple, DeviceMesh] = {}
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, shape, dim_names, args = task
        try:
            key = (shape, dim_names)
            if key not in meshes:
                ranks = torch.arange(math.prod(shape)).reshape(shape)
                meshes[key] = DeviceMesh("cpu", ranks, mesh_dim_names=dim_names)
            mesh = meshes[key]
            results.put((rank, True, fn(mesh if mesh.get_coordinate() is not None else None, *args)))
        except BaseException as exc:  # noqa: BLE001 - report, keep serving
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` spawned processes in one gloo process group, serving tasks."""

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="functional-ce-gloo-")
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, self._init_file, self._tasks[r], self._results),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, mesh_shape: tuple[int, ...], *args: Any,
            dim_names: Optional[tuple[str, ...]] = None) -> list[Any]:
        """``fn(mesh, *args)`` on every process; per-rank results (None outside the mesh)."""
        for q in self._tasks:
            q.put((fn, tuple(mesh_shape), dim_names, args))
        out: list[Any] = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__} did not finish on every rank in {TASK_TIMEOUT_S} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            rank, text = min(errors)
            raise AssertionError(f"rank {rank} of {self.world_size} failed:\n{text}")
        return out

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


def dist_pool_fixture(world_size: int) -> Any:
    """A module-scoped pytest fixture named ``pool``: one :class:`DistPool` of ``world_size``
    processes for the test module that assigns it (``pool = dist_pool_fixture(2)``)."""
    import pytest

    @pytest.fixture(scope="module")
    def pool() -> Iterator[DistPool]:
        processes = DistPool(world_size)
        yield processes
        processes.close()

    return pool
