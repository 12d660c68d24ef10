""":class:`MemoryEstimate`: the bytes of one training step, per process, and how it prints."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["MemoryEstimate", "NOT_COUNTED", "format_bytes"]

#: What neither the estimate nor its live-tensor measurement sees (the footer of the table).
NOT_COUNTED = (
    "not counted: allocator fragmentation and cached (reserved but free) blocks, cuBLAS/cuDNN/NCCL "
    "workspaces, the CUDA context, communication buffers outside tensors, and memory a custom op "
    "or kernel allocates inside itself without returning it (functional_ce's operators report theirs: "
    "the chunk workspace row)"
)


def format_bytes(n: int) -> str:
    """``n`` bytes as GiB (from 1 GiB) or MiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one steady-state training step (forward, backward, optimizer step), per process.

    Attributes (integer bytes; with ``world_size`` > 1, FSDP2 per-process bytes):
        params: parameters (their shards under FSDP2, padded as FSDP2 pads dim 0).
        buffers: buffers (never sharded).
        grads: parameter gradients after backward (sharded under FSDP2).
        optimizer: optimizer state alive between steps (sharded under FSDP2).
        activations: bytes forward keeps alive when it returns, parameters, buffers, optimizer
            state and the loss excluded (what checkpointing reduces).
        peak: the most bytes alive at once over the step, everything included: parameters,
            buffers, optimizer state, gradients as they accumulate, activations, recompute,
            temporaries (and, under FSDP2, gathered parameters and gradient buffers).
        phase_peaks: ``(phase, bytes)``: the most bytes alive in each phase (``peak`` is the largest).
        workspace: the largest chunk workspace a loss operator of ``functional_ce`` allocated
            inside itself (its chunk buffers at the chunk size in force; counted in ``peak`` at
            that operator, as the operators report it).
        peak_phase: ``"forward"``, ``"backward"`` or ``"optimizer"``: when the peak happens.
        peak_module: fully qualified name of the innermost module running at the peak (``""``:
            the model itself, outside any submodule; backward keeps a module's name from its
            outputs' gradient to its inputs').
        world_size: processes the parameters are sharded over (1: no sharding).
        context_parallel: processes the sequence is sharded over (1: none); the bytes are one
            of them's, its shard's activations and the gathered keys and values.
        device: whose allocator rounding the bytes follow (``"cpu"``: exact ``nbytes``;
            ``"cuda"``: each storage rounded up to 512 bytes).
        fake: True for an estimate on fake tensors, False for a measured step.
    """

    params: int
    buffers: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    peak_phase: str
    peak_module: str
    world_size: int = 1
    device: str = "cpu"
    fake: bool = True
    note: Optional[str] = None
    workspace: int = 0
    phase_peaks: tuple[tuple[str, int], ...] = ()
    context_parallel: int = 1

    def __str__(self) -> str:
        what = "estimated on fake tensors" if self.fake else "measured (live tensors)"
        shard = f", FSDP2 over {self.world_size} processes (per process)" if self.world_size > 1 else ""
        if self.context_parallel > 1:
            shard += f", the sequence sharded over {self.context_parallel} processes (one's shard)"
        rows = [("parameters", self.params), ("buffers", self.buffers), ("gradients", self.grads),
                ("optimizer state", self.optimizer), ("activations kept after forward", self.activations),
                ("loss chunk workspace", self.workspace), ("step peak", self.peak)]
        width = max(len(r[0]) for r in rows)
        lines = [f"training step memory, {what}{shard}, {self.device} rounding"]
        lines += [f"  {name:<{width}}  {format_bytes(n):>12}" for name, n in rows]
        lines.append(f"  peak in {self.peak_phase}, inside {self.peak_module or '(the model itself)'}")
        if self.note:
            lines.append(f"  {self.note}")
        lines.append(f"  {NOT_COUNTED}")
        return "\n".join(lines)
