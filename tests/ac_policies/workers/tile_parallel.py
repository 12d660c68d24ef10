"""What each process runs for the tiled-MLP tests under FSDP2 and DTensor tensor parallelism: a
tiny dense model with its MLPs tiled (alone, and inside checkpointed blocks), against the same
model untiled; the collectives of each step are counted."""

from __future__ import annotations

import warnings

import torch.distributed as dist

import ac_policies
from bench.harness.comm_bytes import CommBytes
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model

TILED = [{"when": "dense_mlp", "action": "tile", "tiles": 4}]
TILED_IN_FULL = [{"when": "decoder_block", "action": "checkpoint"}, *TILED]


def _full(grads: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}


def _step(policy, ids, parallelise):
    model = tiny_ac_model("llama", use_cache=False)
    if policy is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(model, policy)
    parallelise(model)
    with CommBytes() as comm:
        loss, grads = loss_and_grads(model, ids)
    return loss, _full(grads), dict(comm.calls)


def _fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def fsdp_step(mesh, policy_name):
    """Loss, gathered gradients and collective calls of one FSDP2 step, untiled and with ``policy_name``
    (``"tiled"`` or ``"tiled_in_full"``)."""
    if mesh is None:
        return None
    ids = token_batch(seed=dist.get_rank(), s=16)
    policy = {"tiled": TILED, "tiled_in_full": TILED_IN_FULL}[policy_name]
    return {"untiled": _step(None, ids, _fully_shard), "tiled": _step(policy, ids, _fully_shard)}


def _tensor_parallel(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def apply(model):
        for layer in model.model.layers:
            parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                  "down_proj": RowwiseParallel()})
    return apply


def tp_step(mesh):
    """Loss and full gradients of one step with the MLPs tensor-parallel (DTensor), untiled and tiled;
    every rank runs the same batch."""
    if mesh is None:
        return None
    ids = token_batch(seed=0, s=16)
    apply = _tensor_parallel(mesh)
    return {"untiled": _step(None, ids, apply), "tiled": _step(TILED, ids, apply)}
