"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the full-stack policy tests:
a tiny Qwen3-MoE with an ``ac_policies`` preset, per-block ``torch.compile`` and FSDP2
``fully_shard``, in torchtitan's order (policy, then per-block compile, then ``fully_shard``) or
in another order, against the single-process model without checkpointing."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import ac_policies
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model


class RecomputeCounter:
    """An ``aot_eager``-like backend that counts, in the backward graphs it is handed, the matmuls
    producing router logits ``[tokens, experts]``: each is the router's forward rerun by a
    checkpoint recompute (backward itself never produces that shape)."""

    def __init__(self, tokens: int, experts: int) -> None:
        self.shape = (tokens, experts)
        self.router_recomputes = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def forward_compiler(g: torch.fx.GraphModule, _inputs: list) -> object:
            return make_boxed_func(g.forward)

        def backward_compiler(g: torch.fx.GraphModule, _inputs: list) -> object:
            for node in g.graph.nodes:
                val = node.meta.get("val")
                if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and \
                        val is not None and tuple(val.shape) == self.shape:
                    self.router_recomputes += 1
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(gm, example_inputs)


def _compile_blocks(model: torch.nn.Module, backend: object) -> None:
    for layer in model.model.layers:
        layer.compile(backend=backend)


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def full_stack_step(mesh, preset, backend, order=("policy", "compile", "shard")):
    """One step on this rank's batch. Returns the loss, every gradient (gathered), the reference
    (mean over ranks of the unsharded model's gradients without checkpointing) and, with
    ``backend="count-recomputes"``, how many router matmuls the compiled backward graphs rerun;
    or the error an order raised."""
    if mesh is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = token_batch(seed=rank, s=8)
    reference = tiny_ac_model("qwen3_moe", use_cache=False)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    for g in ref_grads.values():
        dist.all_reduce(g)
        g /= world
    model = tiny_ac_model("qwen3_moe", use_cache=False)
    counter = RecomputeCounter(ids.numel(), model.config.num_experts)
    if backend == "count-recomputes":
        backend = counter
    try:
        for step in order:
            if step == "policy":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
                    ac_policies.apply_policy(model, preset)
            elif step == "compile":
                _compile_blocks(model, backend)
            else:
                _shard(model)
        loss, grads = loss_and_grads(model, ids)
    except (ValueError, TypeError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    from torch.distributed.tensor import DTensor

    grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    return {"error": None, "loss": loss, "ref_loss": ref_loss, "grads": grads, "ref_grads": ref_grads,
            "router_recomputes": counter.router_recomputes}
