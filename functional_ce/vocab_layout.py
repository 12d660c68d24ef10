"""DTensor layouts the vocabulary-parallel losses serve, and the O(N) collectives that combine
per-slice statistics.

A layout is accepted when the vocabulary is sharded (``Shard`` on the class dim) over at most
one mesh dim and every other mesh dim is ``Replicate()``; token rows are whole on every process.
Everything else raises ``ValueError`` naming the placements and the supported layouts.
Vocabulary shards follow DTensor's own rule (``torch.chunk``): ``ceil(V / p)`` classes per
process, the last ones smaller or empty.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
import torch.distributed._functional_collectives as funcol

LOGITS_LAYOUTS = (
    "logits: Shard(-1) (the vocabulary) on at most one mesh dim and Replicate() on every other mesh dim"
)
WEIGHT_LAYOUTS = (
    "weight [V, H]: Shard(0) (a column-parallel lm_head) on at most one mesh dim and Replicate() on every "
    "other; hidden: a DTensor on the same mesh, Replicate() or Shard(token dim) (sequence parallel) on the "
    "weight's shard dim and Replicate() elsewhere; bias: sharded like the weight"
)


@dataclasses.dataclass(frozen=True)
class VocabSlice:
    """Which classes this process holds.

    Attributes:
        mesh: the device mesh of the sharded input.
        mesh_dim: the mesh dim that shards the vocabulary, or None when it is not sharded.
        start: the class id of this process's first column.
        size: how many classes this process holds (may be 0).
        n_classes: the full vocabulary size V.
    """

    mesh: DeviceMesh
    mesh_dim: Optional[int]
    start: int
    size: int
    n_classes: int


def _describe(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def vocab_slice(t: DTensor, class_dim: int, what: str, layouts: str) -> VocabSlice:
    """The vocabulary slice of ``t`` whose classes run along ``class_dim``; raises ``ValueError``
    for any other placement than ``Shard(class_dim)`` on one mesh dim and ``Replicate()``."""
    class_dim = class_dim % t.dim()
    mesh, placements = t.device_mesh, t.placements
    shard_dims = []
    for i, p in enumerate(placements):
        if type(p) is Shard and p.dim % t.dim() == class_dim:
            shard_dims.append(i)
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"{what} has placements {_describe(placements)}: {p!r} on mesh dim {i} is not supported. "
                f"Supported: {layouts}"
            )
    if len(shard_dims) > 1:
        raise ValueError(
            f"{what} has placements {_describe(placements)}: the vocabulary is sharded on mesh dims {shard_dims}, "
            f"at most one is supported. Supported: {layouts}"
        )
    n_classes = t.shape[class_dim]
    if not shard_dims:
        return VocabSlice(mesh, None, 0, n_classes, n_classes)
    mesh_dim = shard_dims[0]
    ranks = mesh.size(mesh_dim)
    per_rank = -(-n_classes // ranks)
    start = min(mesh.get_local_rank(mesh_dim) * per_rank, n_classes)
    size = min(n_classes, start + per_rank) - start
    local = t.to_local().shape[class_dim]
    if local != size:
        raise ValueError(
            f"{what}'s local shard has {local} classes where DTensor's Shard rule gives {size} "
            f"(V={n_classes} over {ranks} processes); build it with distribute_tensor or from_local with even "
            "chunks as torch.chunk makes them"
        )
    return VocabSlice(mesh, mesh_dim, start, size, n_classes)


def replicated_local(name: str, t: object, mesh: DeviceMesh) -> object:
    """A per-token argument (labels, mask, weights, a count) as a plain local tensor: a plain
    tensor is taken as it is (it must be the same on every process), a DTensor must be
    ``Replicate()`` on every dim of ``mesh``."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh != mesh or not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(
            f"{name} is a DTensor with placements {_describe(t.placements)} on mesh {t.device_mesh}; it must cover "
            f"all tokens on every process: a plain tensor, or a DTensor Replicate() on every dim of the input's "
            f"mesh {mesh} (labels sharded differently from the rows are not supported)"
        )
    return t.to_local()


def replicate_result(result: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The loss (the same on every process) as a DTensor ``Replicate()`` on every mesh dim."""
    return DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)


def combine_stats(
    stats: torch.Tensor, vocab: VocabSlice, with_total: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary ``(lse, target, total)`` ``[N]`` fp32 from this slice's ``[3, N]`` statistics.

    Two all-reduces over the vocabulary's mesh dim: a MAX of the slices' logsumexp (4 bytes per
    row), then one SUM of ``exp(lse_slice - max)``, the target logit and, with ``with_total``
    (label smoothing), the logit sum (8 or 12 bytes per row). Without ``with_total`` the returned
    ``total`` is the slice's own (the loss does not use it). No collective when the vocabulary is
    not sharded.
    """
    lse, target, total = stats.unbind(0)
    if vocab.mesh_dim is None:
        return lse, target, total
    group = (vocab.mesh, vocab.mesh_dim)
    top = funcol.all_reduce(lse, "max", group)
    top = torch.where(torch.isfinite(top), top, 0.0)  # all -inf rows stay -inf, +inf rows +inf
    parts = [torch.exp(lse - top), target] + ([total] if with_total else [])
    summed = funcol.all_reduce(torch.stack(parts), "sum", group)
    global_lse = top + torch.log(summed[0])
    return global_lse, summed[1], summed[2] if with_total else total
