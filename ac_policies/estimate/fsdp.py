"""FSDP2 per-process bytes, modelled on a single-process trace (:class:`.trace.TracedStep`).

The model (``fully_shard`` on each decoder block, then on the root; no mixed precision; blocks
reshard after forward, the root does not):

- Parameters, gradients (once their unit's backward is done) and optimizer state shaped like a
  parameter are sharded on dim 0: each process holds ``ceil(dim0 / N)`` rows, as FSDP2 pads.
  Buffers and scalar optimizer state (AdamW's ``step``) are replicated.
- Activations are those of the single-process trace (every process runs its own batch of the
  shape ``step`` builds).
- A unit's parameters are gathered (whole, next to the shards) while it runs: the root's from
  the start of forward to the end of backward; a block's while ModTracker sees it running in
  forward, and in backward from its outputs' gradient to its inputs' (recompute included). In
  backward the next block's all-gather is prefetched, so its parameters are gathered too.
- Transients: the flat all-gather output (the unit's bytes) when a block is gathered in forward,
  and the reduce-scatter input (the unit's gradient bytes) when its backward ends; its unsharded
  gradients are alive until then.
- Optimizer temporaries scale with the shards (the optimizer runs on the local shards).

With ``offload=True`` (FSDP2's ``CPUOffloadPolicy``, on any number of processes, one included):
the parameter shards, the sharded gradients and the optimizer state live in host memory and the
optimizer step runs there. The device holds the buffers, the gathered parameters of the units
running (in the parameters' dtype, one unit and the prefetched next), the unsharded gradients of
the unit whose backward runs, and the activations.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from torch import nn

from ..plan import ACPolicyWarning, plan
from ..rules import Rule
from ..table import Policy
from .trace import TracedStep

__all__ = ["decoder_blocks", "fsdp_peak", "shard_bytes"]


def decoder_blocks(model: nn.Module) -> list[str]:
    """Fully qualified names of the decoder blocks (found by structure, as the presets find them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ACPolicyWarning)
        rows = plan(model, Policy((Rule(when="decoder_block", action="checkpoint", on_unmatched="ignore"),)))
    return [r.fqn for r in rows]


def shard_bytes(shape: torch.Size, itemsize: int, world: int) -> int:
    """Bytes of one process's dim-0 shard of a tensor, padded as FSDP2 pads: ``ceil(dim0 / world)`` rows."""
    if len(shape) == 0:
        return itemsize
    return math.ceil(shape[0] / world) * math.prod(shape[1:]) * itemsize


def fsdp_peak(model: nn.Module, ts: TracedStep, world: int, size_of: Callable[[int], int], offload: bool = False
              ) -> tuple[dict[str, int], int]:
    """Per-process device ``{"params", "grads", "optimizer", "peak", "phase_peaks"}`` bytes under FSDP2 over
    ``world`` processes (``offload``: with ``CPUOffloadPolicy``), and the op index of the peak in
    ``ts.trace``."""
    blocks = decoder_blocks(model)
    unit_of: dict[str, int] = {}  # parameter name -> unit index (0: root, i + 1: blocks[i])
    full: dict[str, int] = {}
    shard: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        unit_of[name] = next((i + 1 for i, b in enumerate(blocks) if name.startswith(b + ".")), 0)
        full[name] = size_of(p.numel() * p.element_size())
        shard[name] = size_of(shard_bytes(p.shape, p.element_size(), world))
    n_units = len(blocks) + 1
    unit_full = [0] * n_units
    for name, n in full.items():
        unit_full[unit_of[name]] += n
    sharded_params = sum(shard.values())
    full_params = max(sum(full.values()), 1)
    sharded_opt = sum(ts.state_of.get(n, 0) * shard[n] // max(full[n], 1) for n in full)
    shaped_opt = sum(ts.state_of.get(n, 0) for n in full)
    base = sharded_params + ts.buffers + sharded_opt + (ts.optimizer - shaped_opt)
    if offload:
        base = ts.buffers

    trace = ts.trace
    names = [f"{ts.root}.{b}" for b in blocks]
    n_ops = len(trace.totals)
    first_fwd = [-1] * n_units
    bw_start = [-1] * n_units
    bw_end = [-1] * n_units
    last_bw = max((i for i, ph in enumerate(trace.phases) if ph == 1), default=n_ops - 1)
    for i, (ph, mods) in enumerate(zip(trace.phases, trace.modules)):
        for u, name in enumerate(names, start=1):
            if name in mods:
                if ph == 0 and first_fwd[u] < 0:
                    first_fwd[u] = i
                elif ph == 1:
                    bw_start[u] = i if bw_start[u] < 0 else bw_start[u]
                    bw_end[u] = i
    bw_end[0] = last_bw
    bw_order = sorted((u for u in range(1, n_units) if bw_start[u] >= 0), key=lambda u: bw_start[u])

    # gradient bytes by op: full-size from birth, shard-size after the unit's backward ends
    grad_full = [0] * (n_ops + 1)
    grad_sharded = [0] * (n_ops + 1)  # on the device: sharded after the unit's backward, or gone (offload)
    for key, name in ts.grad_keys.items():
        born = trace.born.get(key)
        if born is None or name not in unit_of:
            continue
        b, end = born[1], bw_end[unit_of[name]]
        grad_full[b] += full[name]
        grad_sharded[b] += full[name]
        if end >= b:
            grad_sharded[end + 1] += (0 if offload else shard[name]) - full[name]
    best, at = -1, 0
    by_phase: dict[int, int] = {}
    gf = gs = 0
    for i in range(n_ops):
        gf += grad_full[i]
        gs += grad_sharded[i]
        ph, mods = trace.phases[i], trace.modules[i]
        act = trace.totals[i] - gf
        if offload and ph == 2:
            continue  # the optimizer step runs in host memory
        if ph == 2:
            act = act * sharded_params // full_params
            gathered = 0
        else:
            active = [u for u, name in enumerate(names, start=1) if name in mods]
            gathered = unit_full[0] + sum(unit_full[u] for u in active)
            if ph == 0:
                gathered += sum(unit_full[u] for u in active if first_fwd[u] == i)
            else:
                ahead = [u for u in bw_order if bw_start[u] > i]
                started = [u for u in bw_order if bw_start[u] <= i and u not in active]
                if ahead and (active or started):
                    gathered += unit_full[ahead[0]]  # the next block's prefetched all-gather
                gathered += sum(unit_full[u] for u in range(n_units) if bw_end[u] == i)  # reduce-scatter input
        total = base + act + gs + gathered
        by_phase[ph] = max(by_phase.get(ph, 0), total)
        if total > best:
            best, at = total, i
    grads = sum(shard[n] for n in ts.grad_keys.values() if n in shard)
    if offload:
        return {"params": 0, "grads": 0, "optimizer": 0, "peak": best, "phase_peaks": _named(by_phase)}, at
    return {"params": sharded_params, "grads": grads, "optimizer": base - sharded_params - ts.buffers,
            "peak": best, "phase_peaks": _named(by_phase)}, at


def _named(by_phase: dict[int, int]) -> tuple[tuple[str, int], ...]:
    from .trace import PHASES

    return tuple((PHASES[p], n) for p, n in sorted(by_phase.items()))
