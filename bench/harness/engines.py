"""Accelerate's engines on CPU processes for the tests: the environment a pool process needs so
that ``PartialState`` sees the process group it already belongs to, a fresh Accelerate state per
task, and the one override that reaches Accelerate's FSDP2 code path without an accelerator.

What Accelerate decides on a CPU, and what :func:`accelerate_fsdp_on_cpu` overrides: with
``cpu=True`` (``TrainingArguments(use_cpu=True)``) and several processes,
``PartialState._prepare_backend`` picks ``DistributedType.MULTI_CPU`` with gloo, and
``AcceleratorState.__init__`` turns a distributed type into ``FSDP`` only for the accelerator
types (``MULTI_GPU``, ``MULTI_XPU``, ... never ``MULTI_CPU``), so a ``fsdp_plugin`` is dropped
without a word and ``prepare`` wraps the model in ``DistributedDataParallel``. Without
``cpu=True`` and no accelerator it picks ``NO`` and wraps nothing. The override runs
``AcceleratorState.__init__`` unchanged and then, only where it chose ``MULTI_CPU`` and a
``fsdp_plugin`` was given, does what that method does for an accelerator type: sets the
distributed type to ``FSDP`` (on ``PartialState`` too), hands the plugin its mixed precision and
keeps the plugin. Devices, the process group, the data loaders, ``prepare``, ``fully_shard`` and
the optimizer step are Accelerate's and torch's own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator


def distributed_env(rank: int, world_size: int) -> None:
    """The launcher's environment variables, for a process that already joined its group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))


def single_process_env() -> None:
    """No launcher: the variables :func:`distributed_env` sets are removed."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state (a previous task's accelerator and plugins)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def enter_run(world: int, joined: bool) -> bool:
    """Set this process up for one trainer run on ``world`` processes: the launcher's variables
    (or none on one process) and fresh Accelerate state, with functional_ce's eager maths.
    False when ``world > 1`` and this process did not join the run's group (``joined``)."""
    import torch.distributed as dist

    os.environ.setdefault("FUNCTIONAL_CE_COMPILE", "0")
    if world > 1:
        if not joined:
            return False
        distributed_env(dist.get_rank(), world)
    else:
        single_process_env()
    reset_accelerate()
    return True


@contextlib.contextmanager
def accelerate_fsdp_on_cpu() -> Iterator[None]:
    """Within the block, an ``AcceleratorState`` built with ``cpu=True`` on several processes and a
    ``fsdp_plugin`` takes Accelerate's FSDP path (see the module docstring for exactly what
    changes); undone on exit."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


@contextlib.contextmanager
def accelerate_deepspeed_on_cpu() -> Iterator[None]:
    """Within the block, Accelerate counts the launcher's processes when DeepSpeed runs on CPU.

    Without an accelerator ``PartialState._prepare_backend`` picks ``DistributedType.NO`` when
    ``cpu=False`` (DeepSpeed needs ``cpu=False``: with ``cpu=True`` Accelerate drops it), so
    ``TrainingArguments.world_size`` is 1 while DeepSpeed's engine counts every process, and
    Transformers refuses the batch sizes ("ds train_batch_size=4 vs hf train_batch_size
    (calculated)=2"). The override makes that one decision ``MULTI_CPU`` with gloo where the
    launcher set ``LOCAL_RANK``; Accelerate then turns it into ``DEEPSPEED`` as it does on an
    accelerator. DeepSpeed runs on its own CPU accelerator (``DS_ACCELERATOR=cpu``)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: Any = None) -> Any:
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if kind == DistributedType.NO and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    PartialState._prepare_backend = _prepare_backend
    try:
        yield
    finally:
        PartialState._prepare_backend = original
