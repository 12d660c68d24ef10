"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the pipeline-parallel tests.

A tiny 4-block language model (embedding, two tanh layers, the LM head) is built from one seed
on every rank and split into pipeline stages: two stages (one per rank) for GPipe and 1F1B,
four (two per rank) for the interleaved and zero-bubble schedules. The last stage's ``loss_fn``
is ``functional_ce.cross_entropy`` with ``reduction="sum"`` divided by the global label count
(``num_label_tokens``), so the schedule runs with ``scale_grads=False``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import functional_ce

V, H, B, T, MICROBATCHES = 37, 16, 8, 6, 4


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.Embedding(V, H) if kind == "embed" else nn.Linear(H, V if kind == "head" else H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return torch.tanh(y) if self.kind == "hidden" else y


def blocks(seed: int = 0) -> list[Block]:
    torch.manual_seed(seed)
    return [Block("embed"), Block("hidden"), Block("hidden"), Block("head")]


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.where(torch.rand(B, T, generator=g) < 0.25, -100, torch.randint(0, V, (B, T), generator=g))
    return ids, labels


def reference() -> dict[str, Any]:
    """The unpipelined model: summed loss over the global count, and each block's gradients."""
    model = nn.Sequential(*blocks())
    ids, labels = batch()
    count = int((labels != -100).sum())
    loss = functional_ce.cross_entropy(model(ids), labels, reduction="sum", num_label_tokens=count)
    loss.backward()
    return {"loss": loss.detach(), "grads": {i: [p.grad for p in b.parameters()] for i, b in enumerate(model)}}


#: schedule name -> (stages per rank, which blocks each stage of rank r holds)
LAYOUTS = {
    "GPipe": (1, lambda r: [[0, 1]] if r == 0 else [[2, 3]]),
    "1F1B": (1, lambda r: [[0, 1]] if r == 0 else [[2, 3]]),
    "Interleaved1F1B": (2, lambda r: [[r], [r + 2]]),
    "InterleavedZeroBubble": (2, lambda r: [[r], [r + 2]]),
    "ZBVZeroBubble": (2, lambda r: [[0], [3]] if r == 0 else [[1], [2]]),
}


def _stage_indices(name: str, rank: int) -> list[int]:
    if name == "ZBVZeroBubble":
        return [0, 3] if rank == 0 else [1, 2]
    per_rank = LAYOUTS[name][0]
    return [rank + 2 * i for i in range(per_rank)]


def pipeline_step(mesh, name, inplace, return_outputs):
    """One step of schedule ``name``; per-block gradients of the blocks this rank holds, the
    per-microbatch losses (last stage) and the returned outputs (if any)."""
    from torch.distributed import pipelining as pp

    if mesh is None:
        return None
    rank = dist.get_rank()
    all_blocks = blocks()
    groups = LAYOUTS[name][1](rank)
    indices = _stage_indices(name, rank)
    n_stages = 2 * len(groups)
    stages = [
        pp.PipelineStage(nn.Sequential(*[all_blocks[i] for i in group]), idx, n_stages, torch.device("cpu"),
                         group=mesh.get_group())
        for group, idx in zip(groups, indices)
    ]
    ids, labels = batch()
    count = int((labels != -100).sum())

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return functional_ce.cross_entropy(output, target, reduction="sum", num_label_tokens=count,
                                           inplace_grad=inplace)

    cls = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B, "Interleaved1F1B": pp.ScheduleInterleaved1F1B,
           "InterleavedZeroBubble": pp.ScheduleInterleavedZeroBubble, "ZBVZeroBubble": pp.ScheduleZBVZeroBubble}[name]
    stage_arg = stages[0] if len(stages) == 1 else stages
    schedule = cls(stage_arg, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    losses: list[torch.Tensor] = []
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    args = (ids,) if is_first else ()
    output = schedule.step(*args, target=labels if is_last else None, losses=losses,
                           return_outputs=return_outputs)
    held = {i: [p.grad.detach().clone() if p.grad is not None else None for p in all_blocks[i].parameters()]
            for group in groups for i in group}
    return {"grads": held, "losses": [loss.detach() for loss in losses] if is_last else None,
            "output": output.detach().clone() if isinstance(output, torch.Tensor) else None}


class LastStage(nn.Module):
    """The last stage when the loss owns the LM head: emits hidden states, holds the head."""

    def __init__(self, hidden_block: Block, head: nn.Linear) -> None:
        super().__init__()
        self.block, self.head = hidden_block, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def microbatch_mean_reference() -> dict[str, Any]:
    """The unpipelined model with the loss each microbatch's mean, averaged over microbatches
    (what ``scale_grads=True`` with ``reduction="mean"`` computes)."""
    model = nn.Sequential(*blocks())
    ids, labels = batch()
    total = 0.0
    for mb_ids, mb_labels in zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES)):
        total = total + functional_ce.cross_entropy(model(mb_ids), mb_labels) / MICROBATCHES
    total.backward()
    return {"loss": total.detach(), "grads": {i: [p.grad for p in b.parameters()] for i, b in enumerate(model)}}


def hidden_state_loss_step(mesh, scale_grads):
    """GPipe with the last stage emitting hidden states and ``pipeline_loss_fn`` applying the
    head: ``reduction="mean"`` per microbatch with ``scale_grads=True``, or the sum over the
    global label count with ``scale_grads=False``."""
    from torch.distributed import pipelining as pp

    if mesh is None:
        return None
    rank = dist.get_rank()
    all_blocks = blocks()
    module = nn.Sequential(all_blocks[0], all_blocks[1]) if rank == 0 else LastStage(all_blocks[2],
                                                                                      all_blocks[3].layer)
    stage = pp.PipelineStage(module, rank, 2, torch.device("cpu"), group=mesh.get_group())
    ids, labels = batch()
    count = int((labels != -100).sum())
    options = {"reduction": "mean"} if scale_grads else {"reduction": "sum", "num_label_tokens": count}
    loss_fn = functional_ce.pipeline_loss_fn(all_blocks[3].layer, **options)
    schedule = pp.ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=scale_grads)
    losses: list[torch.Tensor] = []
    schedule.step(*((ids,) if rank == 0 else ()), target=labels if rank == 1 else None, losses=losses,
                  return_outputs=False)
    held = [0, 1] if rank == 0 else [2, 3]
    return {"grads": {i: [p.grad.detach().clone() for p in all_blocks[i].parameters()] for i in held},
            "losses": [loss.detach() for loss in losses] if rank == 1 else None}
