"""``estimate(model, step)``: the memory of one training step on fake tensors, and
``measure_step``: the same accounting on a real step (the ground truth it is checked against)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..fake import fake_model
from ..offload import modelling_offload
from ..seam import unpacked_rows_on_fakes
from .fsdp import fsdp_peak
from .result import MemoryEstimate, format_bytes
from .trace import PHASES, TracedStep, cuda_block_bytes, trace_step

__all__ = ["estimate", "measure_step"]

Step = Callable[[nn.Module], torch.Tensor]


def _size_of(device: Optional[str]) -> tuple[str, Callable[[int], int]]:
    kind = "cpu" if device is None else torch.device(device).type
    if kind == "cuda":
        return kind, cuda_block_bytes
    if kind == "cpu":
        return kind, int
    raise ValueError(f"device must be None, 'cpu' or 'cuda' (whose allocator rounding to model), got {device!r}")


def _check(model: nn.Module, step: Any, world_size: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"step must be a callable taking the model and returning the loss, got {type(step).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (FSDP2 processes; 1: no sharding), got {world_size!r}")
    if not model.training:
        raise ValueError("estimate() runs a training step: put the model in training mode (model.train()) first")


def _module_at(ts: TracedStep, index: int) -> str:
    names = [n for n in ts.trace.modules[index] if n != "Global"] if ts.trace.modules else []
    if not names:
        return ""
    deepest = max(names, key=lambda n: (n.count("."), len(n)))
    return deepest[len(ts.root) + 1:] if deepest.startswith(ts.root + ".") else ""


def _summarise(model: nn.Module, ts: TracedStep, world_size: int, device: str, fake: bool,
               size_of: Callable[[int], int], offload_params: bool = False) -> MemoryEstimate:
    totals = ts.trace.totals or [0]
    note = None
    if offload_params:
        note = (f"parameters ({format_bytes(ts.params)}), gradients and optimizer state ({format_bytes(ts.optimizer)}) "
                "in host memory (FSDP2 CPUOffloadPolicy); on the device: the units' gathered parameters")
    if world_size == 1 and not offload_params:
        at = max(range(len(totals)), key=totals.__getitem__)
        held = ts.params + ts.buffers + ts.optimizer
        by_phase: dict[str, int] = {}
        for total, phase in zip(totals, ts.trace.phases or [0] * len(totals)):
            by_phase[PHASES[phase]] = max(by_phase.get(PHASES[phase], 0), held + total)
        parts = {"params": ts.params, "grads": ts.grads, "optimizer": ts.optimizer, "peak": held + totals[at],
                 "phase_peaks": tuple(by_phase.items())}
    else:
        parts, at = fsdp_peak(model, ts, world_size, size_of, offload=offload_params)
    phase = PHASES[ts.trace.phases[at]] if ts.trace.phases else "forward"
    return MemoryEstimate(buffers=ts.buffers, activations=ts.activations, peak_phase=phase, workspace=ts.trace.workspace,
                          peak_module=_module_at(ts, at), world_size=world_size, device=device, fake=fake, note=note,
                          **parts)


def estimate(model: nn.Module, step: Step, *, optimizer: Any = "adamw", world_size: int = 1,
             device: Optional[str] = None, offload_params: bool = False, context_parallel: int = 1) -> MemoryEstimate:
    """The memory of one training step of ``model``, from a run on fake tensors.

    Args:
        model: an ``nn.Module`` in training mode, with whatever policy (``apply_policy``) and loss
            patches (``model_patches.enable_linear_cross_entropy``) it will train with. Built on the
            meta device at full size (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
            or with real weights: either way it is not modified (its parameters and buffers are
            replaced by fake copies for the run and put back after it).
        step: ``step(model) -> loss``: builds its inputs itself (inside the run they are fake
            tensors: ``torch.randint(0, V, (1, 32768))`` costs nothing) and returns the scalar
            loss; ``estimate`` runs the backward and the optimizer step.
        optimizer: ``"adamw"`` (``torch.optim.AdamW``, foreach: its default on CUDA, two states
            per parameter in the parameter's dtype, a step scalar, parameter-sized temporaries),
            ``"adamw_fused"``, ``"sgd"`` (momentum: one buffer per parameter), None (no optimizer
            step), or a callable ``params -> torch.optim.Optimizer``. The real optimizer runs on
            the fake parameters, so its state and temporaries are its own.
        world_size: FSDP2 processes (``fully_shard`` on each decoder block and the root); the
            per-process bytes are modelled on the single-process trace as
            :mod:`ac_policies.estimate.fsdp` describes. No process group is needed.
        offload_params: FSDP2's ``CPUOffloadPolicy`` (on ``world_size`` processes, one included):
            parameters, gradients and optimizer state in host memory, the optimizer step run there;
            the device holds the gathered parameters of one unit (and the prefetched next), the
            gradients of the unit whose backward runs, and the activations. ``params``, ``grads``
            and ``optimizer`` are then 0 (device bytes) and the note says what is in host memory.
        context_parallel: processes the packed sequence is sharded over
            (``model_patches.enable_context_parallel``); ``step`` then runs one process's shard
            (``T / context_parallel`` tokens, e.g. ``model(**cp.shard(batch))``'s inputs, or plain
            ids of that length: one document per row) and its attention is traced against every
            process's keys and values (the all-gather, ``model_patches.context_parallel.simulate_context_parallel``)
            under a ``[local, T]`` mask. No process group is needed. The model must run sdpa or eager
            attention. Combines with ``world_size`` (FSDP2 over the same processes).
        device: None or ``"cpu"``: exact ``nbytes`` of each storage (each storage once, however
            many views). ``"cuda"``: each storage rounded up to 512 bytes, as the CUDA caching
            allocator rounds a request (segments, caching and fragmentation are not modelled).
            The ops run as fake CPU tensors either way (sdpa picks the CPU kernel's outputs).
            With ``"cuda"``, ``offload`` rules are modelled (:func:`ac_policies.offload.modelled_offload`):
            what they offload is in host memory, and comes back in backward as it is used.

    Returns:
        A :class:`MemoryEstimate` (bytes per process). Not counted: allocator fragmentation and
        cached blocks, cuBLAS/NCCL workspaces, the CUDA context, and what a custom op allocates
        inside itself without returning it, except ``functional_ce``'s operators, which report
        their chunk workspace (counted in the peak, and shown as ``workspace``).

    Raises:
        ValueError: a model in eval mode, a ``world_size`` or ``context_parallel`` that is not a
            positive int, an unknown ``device`` or ``optimizer``, a model context parallelism refuses.
        TypeError: ``step`` does not return a one-element tensor.
    """
    _check(model, step, world_size)
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise ValueError(f"context_parallel must be a positive int (processes the sequence is sharded over; 1: none), "
                         f"got {context_parallel!r}")
    kind, size_of = _size_of(device)
    offload = modelling_offload() if kind == "cuda" else contextlib.nullcontext()
    with contextlib.ExitStack() as stack:
        if context_parallel > 1:
            from model_patches.context_parallel import simulate_context_parallel

            stack.enter_context(simulate_context_parallel(model, context_parallel))
        stack.enter_context(fake_model(model))
        stack.enter_context(unpacked_rows_on_fakes())
        stack.enter_context(offload)
        ts = trace_step(model, step, optimizer, size_of=size_of)
        result = _summarise(model, ts, world_size, kind, True, size_of, offload_params)
    return dataclasses.replace(result, context_parallel=context_parallel)


def measure_step(model: nn.Module, step: Step, *, optimizer: Any = "adamw", device: Optional[str] = None,
                 resized: Optional[Callable[[], list[torch.Tensor]]] = None) -> MemoryEstimate:
    """The same accounting as :func:`estimate` on a real step of ``model`` (real kernels, real
    memory): what the estimate is checked against. ``world_size`` is not modelled: an FSDP2
    model measures its own per-process bytes (pass ``resized``, returning the tensors whose storages
    FSDP2 resizes in place, its all-gather outputs; run one step before, so they exist).

    The optimizer runs at learning rate 0, so the parameters end as they were; their gradients
    are set to None.
    """
    _check(model, step, 1)
    kind, size_of = _size_of(device)
    ts = trace_step(model, step, optimizer, size_of=size_of, resized=resized)
    return _summarise(model, ts, 1, kind, False, size_of)
