"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the FSDP2 estimate
check: a tiny model sharded with ``fully_shard`` (each decoder block, then the root), one warm-up
step (FSDP2 makes its all-gather buffers at the first forward), then the per-process live-tensor
bytes of one measured step (``measure_step``) next to ``estimate(world_size=...)`` of the same
model unsharded."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests.support.tiny_models import tiny_ac_model


def step_for(vocab: int, seq: int, seed: int):
    """``step(model) -> loss`` on a seeded batch of ``seq`` tokens (fake under ``estimate``)."""

    def step(model: torch.nn.Module) -> torch.Tensor:
        ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
        return model(input_ids=ids, labels=ids).loss

    return step


def _fake_safe_step(vocab: int, seq: int):
    def step(model: torch.nn.Module) -> torch.Tensor:
        ids = torch.randint(0, vocab, (1, seq))
        return model(input_ids=ids, labels=ids).loss

    return step


def all_gather_outputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameter storages (resized in place as units gather and reshard)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out += [t for fp in group.fsdp_params for t in fp.all_gather_outputs]
    return out


def prepared_model(family: str, policy: Any, hidden_state: bool, **overrides: Any) -> torch.nn.Module:
    """A tiny ``family`` model (``tiny_ac_model``) with the hidden-state loss if asked and ``policy``
    applied unless it is ``"none"``."""
    import ac_policies
    import model_patches

    model = tiny_ac_model(family, **overrides)
    if hidden_state:
        model_patches.enable_linear_cross_entropy(model)
    if policy != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(model, policy)
    return model


def fsdp_peaks(mesh: Any, family: str, policy: str, hidden_state: bool, seq: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    import ac_policies
    from ac_policies.estimate import measure_step

    if mesh is None:
        return {}
    model = prepared_model(family, policy, hidden_state, hidden_size=64, intermediate_size=128)
    vocab = model.config.vocab_size
    estimated = ac_policies.estimate(model, _fake_safe_step(vocab, seq), world_size=mesh.size())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step = step_for(vocab, seq, 100 + dist.get_rank())
    step(model).backward()  # FSDP2's lazy init: all-gather buffers exist from here on
    model.zero_grad(set_to_none=True)
    measured = measure_step(model, step, resized=lambda: all_gather_outputs(model))
    return {"estimated": estimated, "measured": measured}
