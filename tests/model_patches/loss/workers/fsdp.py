"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the FSDP2 loss tests.

Each task builds the same seeded tiny model on every rank, keeps an unsharded copy as the
reference, shards the model with ``fully_shard`` (each decoder layer, then the root), runs one
step on this rank's own batch, and returns the loss, every parameter's gradient (gathered), the
reference losses and gradients of every rank's batch, and what collectives the step issued.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from bench.harness.comm_bytes import CommBytes
from tests.support.batches import padded_batch
from tests.support.tiny_models import tiny_loss_model


def _shard(model: torch.nn.Module, mesh: Any, shard_head: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if shard_head:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters() if p.grad is not None
    }


def causal_lm_loss_step(mesh, model_type, tied, shard_head, use_library):
    """One step of a ``fully_shard`` model on this rank's batch: ``causal_lm_loss`` when
    ``use_library`` is True, ``model(**batch).loss`` with ``enable_linear_cross_entropy`` when it is
    ``"patched"``, else ``model(**batch).loss``."""
    from torch.distributed.tensor import DTensor

    from model_patches import causal_lm_loss, enable_linear_cross_entropy

    if mesh is None:
        return None
    model = tiny_loss_model(model_type, tie_word_embeddings=tied)
    reference = copy.deepcopy(model)
    _shard(model, mesh, shard_head)
    if use_library == "patched":
        enable_linear_cross_entropy(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = padded_batch(seed=100 + rank)
    with CommBytes() as fwd:
        out = None if use_library is True else model(**batch)
        loss = causal_lm_loss(model, **batch) if use_library is True else out.loss
    head_weight_sharded_after_forward = isinstance(model.lm_head.weight, DTensor)
    with CommBytes() as bwd:
        loss.backward()
    ref_losses, ref_grads = [], []
    for r in range(world):
        reference.zero_grad()
        ref_loss = reference(**padded_batch(seed=100 + r)).loss
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
        ref_grads.append({n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None})
    return {
        "logits_built": out is not None and out.logits is not None,
        "loss": loss.detach(), "is_plain": not isinstance(loss, DTensor), "grads": _full_grads(model),
        "ref_losses": ref_losses, "ref_grads": ref_grads,
        "head_sharded_after_forward": head_weight_sharded_after_forward,
        "head_sharded_after_step": isinstance(model.lm_head.weight, DTensor),
        "forward_calls": dict(fwd.calls), "forward_bytes": dict(fwd.by_op), "backward_calls": dict(bwd.calls),
    }
