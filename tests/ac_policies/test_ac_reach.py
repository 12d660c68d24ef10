"""Blocks recognised by structure on families whose blocks are not `attention + mlp` children:
DBRX (attention inside `norm_attn_norm`), JetMoE (routed attention heads, parallel experts),
Nemotron-H (one mixer per block) and Qwen3-VL-MoE (a vision tower with `linear_fc1`/`linear_fc2`
MLPs). Every preset is bitwise-exact; recompute is counted with forward calls."""

from __future__ import annotations

import warnings

import pytest
import torch

import ac_policies
from tests.ac_policies.probes import PRESETS, call_counts, model_of, recognised, watched_modules
from tests.support.batches import image_batch, step_loss_and_grads, token_batch
from tests.support.tiny_models import AC_REACH_FAMILIES


def inputs(family: str) -> dict[str, torch.Tensor]:
    if family == "qwen3_vl_moe":
        return image_batch()
    ids = token_batch()
    return {"input_ids": ids, "labels": ids}


V, T = "model.visual.blocks", "model.language_model.layers"
# Written from the published architectures (module names as Transformers spells them).
EXPECTED = {
    "dbrx": dict(
        decoder_block=["transformer.blocks.0", "transformer.blocks.1"],
        moe=["transformer.blocks.0.ffn", "transformer.blocks.1.ffn"],
        attention=["transformer.blocks.0.norm_attn_norm.attn", "transformer.blocks.1.norm_attn_norm.attn"],
        dense_mlp=[],
    ),
    "jetmoe": dict(
        decoder_block=["model.layers.0", "model.layers.1"],
        moe=["model.layers.0.mlp", "model.layers.1.mlp"],  # not the attention's own routed heads
        attention=["model.layers.0.self_attention", "model.layers.1.self_attention"],
        dense_mlp=[],
    ),
    "nemotron_h": dict(  # blocks: Mamba-2, MoE, attention, MLP
        decoder_block=[f"model.layers.{i}" for i in range(4)],
        moe=["model.layers.1.mixer"],
        attention=["model.layers.2.mixer"],
        linear_attention=["model.layers.0.mixer"],
        dense_mlp=["model.layers.1.mixer.shared_experts", "model.layers.3.mixer"],
    ),
    "qwen3_vl_moe": dict(
        decoder_block=[f"{V}.0", f"{V}.1", f"{T}.0", f"{T}.1"],
        moe=[f"{T}.0.mlp", f"{T}.1.mlp"],
        attention=[f"{V}.0.attn", f"{V}.1.attn", f"{T}.0.self_attn", f"{T}.1.self_attn"],
        dense_mlp=[f"{V}.0.mlp", f"{V}.1.mlp", "model.visual.merger", "model.visual.deepstack_merger_list.0"],
    ),
}


@pytest.mark.parametrize("family", list(AC_REACH_FAMILIES))
def test_structure_is_recognised(family):
    model = model_of(family)
    for kind, names in EXPECTED[family].items():
        assert recognised(model, kind) == names, kind


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("family", list(AC_REACH_FAMILIES))
def test_every_preset_is_bitwise_exact(family):
    model, kw = model_of(family), inputs(family)
    loss0, grads0 = step_loss_and_grads(model, kw)
    for preset in PRESETS:
        with ac_policies.apply_policy(model, preset) as handle:
            loss1, grads1 = step_loss_and_grads(model, kw)
        assert handle.plan.wrapped and handle.plan.nested == (), preset
        assert torch.equal(loss1, loss0), preset
        assert grads1.keys() == grads0.keys()
        assert [n for n in grads0 if not torch.equal(grads1[n], grads0[n])] == [], preset


@pytest.mark.parametrize("family", list(AC_REACH_FAMILIES))
def test_router_and_experts_run_once_under_non_moe_and_full_reruns_every_block(family):
    model, kw = model_of(family), inputs(family)
    watched = watched_modules(model)
    assert any(n.startswith("router:") for n in watched) and any(n.startswith("mixer:") for n in watched)
    with ac_policies.apply_policy(model, "non_moe"):
        fwd, bwd = call_counts(model, kw, watched)
    for name in watched:
        assert fwd[name] == 1, (name, fwd[name])
        assert bwd[name] == (1 if name.startswith("mixer:") else 0), (name, bwd[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, "full"):
            fwd, bwd = call_counts(model, kw, watched)
    assert all(bwd[n] == 1 for n in watched), bwd  # vision blocks included


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("family", list(AC_REACH_FAMILIES))
def test_router_presets_find_every_router_weight(family):
    """op_sac and keep_router resolve their router globs to each MoE block's router weight."""
    model = model_of(family)
    routers = set()
    for fqn in recognised(model, "moe"):
        kids = dict(model.get_submodule(fqn).named_children())
        router = kids.get("gate", kids.get("router"))
        routers |= {(w.shape[1], w.shape[0]) for n, w in router.named_parameters() if n.endswith("weight")}
    assert routers
    assert ac_policies.plan(model, "keep_router")[0].selective.save_shapes == routers
    assert ac_policies.plan(model, "op_sac")[0].selective.recompute_shapes == routers
