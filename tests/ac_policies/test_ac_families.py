"""ac_policies on tiny random-init Hugging Face models: every family, every preset.

Parity: loss and every parameter gradient equal the model without checkpointing. Counts: what
each preset recomputes is proved by forward calls of leaf modules made during backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ac_policies
from tests.ac_policies.probes import PRESETS, call_counts, model_of, recognised, structure, watched_modules
from tests.support.batches import assert_same_gradients, loss_and_grads, token_batch
from tests.support.tiny_models import AC_FAMILIES, AC_MOE_FAMILIES, tiny_ac_model

# Expected structure of each tiny model, written from the families' published architectures.
EXPECTED = {
    "llama": dict(moe=[], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=["0.mlp", "1.mlp"]),
    "qwen3_moe": dict(moe=["0.mlp", "1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=[]),
    "mixtral": dict(moe=["0.mlp", "1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=[]),
    "deepseek_v3": dict(moe=["1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=["0.mlp", "1.mlp.shared_experts"]),
    "glm4_moe": dict(moe=["1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=["0.mlp", "1.mlp.shared_experts"]),
    "olmoe": dict(moe=["0.mlp", "1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=[]),
    "gpt_oss": dict(moe=["0.mlp", "1.mlp"], attention=["0.self_attn", "1.self_attn"], linear_attention=[], dense_mlp=[]),
    "qwen3_next": dict(moe=["0.mlp", "1.mlp"], attention=["1.self_attn"], linear_attention=["0.linear_attn"], dense_mlp=["0.mlp.shared_expert", "1.mlp.shared_expert"]),
}


@pytest.mark.parametrize("family", list(AC_FAMILIES))
def test_structure_is_recognised(family):
    got = structure(model_of(family))
    for kind, names in EXPECTED[family].items():
        assert got[kind] == [f"model.layers.{n}" for n in names], (kind, got[kind])
    assert got["decoder_block"] == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize("family", list(AC_FAMILIES))
def test_presets_keep_loss_and_gradients(family):
    model = model_of(family)
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    for preset in PRESETS:
        if preset.startswith("non_moe") and family not in AC_MOE_FAMILIES:
            with pytest.raises(ValueError, match="MoE block"):
                ac_policies.apply_policy(model, preset)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            handle = ac_policies.apply_policy(model, preset)
        assert len(handle.plan.wrapped) > 0
        with handle:
            loss1, grads1 = loss_and_grads(model, ids)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        assert_same_gradients(grads1, grads0, preset)


@pytest.mark.parametrize("family", AC_MOE_FAMILIES)
def test_non_moe_runs_router_and_experts_once_and_attention_twice(family):
    model = model_of(family)
    watched = watched_modules(model)
    ids = token_batch()
    with ac_policies.apply_policy(model, "non_moe"):
        fwd, bwd = call_counts(model, dict(input_ids=ids, labels=ids), watched)
    for name in watched:
        kind = name.split(":")[0]
        assert fwd[name] == 1, (name, fwd[name])
        assert bwd[name] == (1 if kind == "mixer" else 0), (name, bwd[name])
    # the same counter sees the router and experts rerun under `full`: the counts can fail
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, "full"):
            fwd, bwd = call_counts(model, dict(input_ids=ids, labels=ids), watched)
    assert all(bwd[n] == 1 for n in watched), bwd
    # and nothing reruns without a policy
    fwd, bwd = call_counts(model, dict(input_ids=ids, labels=ids), watched)
    assert sum(bwd.values()) == 0 and all(fwd[n] == 1 for n in watched)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_non_moe_no_attn_leaves_softmax_attention_alone(family):
    model = model_of(family)
    watched = watched_modules(model)
    with ac_policies.apply_policy(model, "non_moe_no_attn"):
        _, bwd = call_counts(model, dict(input_ids=token_batch(), labels=token_batch()), watched)
    for name in watched:
        rerun = name.startswith("mixer:") and "linear_attn" in name  # linear attention is still checkpointed
        assert bwd[name] == int(rerun), (name, bwd[name])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss"])
def test_recompute_flops_per_preset(family):
    """FLOPs rerun in backward: none under `none`, none inside MoE blocks under `non_moe`.

    The recompute count must equal the growth of FlopCounterMode's total over the step.
    """
    from ac_policies.measure import flop_counter, recompute_flops

    model = model_of(family)
    ids = token_batch()
    moe = recognised(model, "moe")
    step = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731

    def total_flops() -> int:
        with flop_counter() as counter:
            step().backward()
        return counter.get_total_flops()

    base_total = total_flops()
    found = {}
    for preset in ("none", "full", "non_moe"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            with ac_policies.apply_policy(model, preset):
                found[preset] = recompute_flops(model, step, moe)
                assert found[preset][0] == total_flops() - base_total
    assert found["none"] == (0, 0)
    assert found["full"][1] > 0 and found["full"][0] > found["full"][1]  # full reruns MoE and attention
    assert found["non_moe"][1] == 0 and found["non_moe"][0] > 0

    # attribution: under `full` each mixer is rerun whole, so its recompute equals its forward FLOPs
    s = structure(model)
    mixers = s["attention"] + s["linear_attention"]
    with flop_counter() as counter:  # grad on: under no_grad the counter's module tracker raises on Qwen3-Next's conv function module (torch 2.13)
        step()
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    mixer_forward = sum(per_module[f"{type(model).__name__}.{f}"] for f in mixers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, "full"):
            total, mixer_recompute = recompute_flops(model, step, mixers)
    assert mixer_recompute == mixer_forward
    if not s["dense_mlp"]:  # every FLOP of a block is in its mixer or its MoE block
        assert total == mixer_recompute + found["full"][1]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_names_types_state_dict_and_undo(family):
    model = model_of(family)
    before_modules = [(n, type(m)) for n, m in model.named_modules()]
    before_params = [n for n, _ in model.named_parameters()]
    before_keys = list(model.state_dict().keys())
    classes = {n: type(m) for n, m in model.named_modules()}
    handle = ac_policies.apply_policy(model, "non_moe")
    wrapped = {r.fqn for r in handle.plan.wrapped}
    assert [(n, type(m)) for n, m in model.named_modules()] == before_modules
    assert [n for n, _ in model.named_parameters()] == before_params
    assert list(model.state_dict().keys()) == before_keys
    assert all(isinstance(m, classes[n]) for n, m in model.named_modules())
    assert {n for n, m in model.named_modules() if "forward" in m.__dict__} == wrapped
    with pytest.raises(ValueError, match="already has an activation-checkpointing policy"):
        ac_policies.apply_policy(model, "non_moe")
    handle.remove()
    handle.remove()  # idempotent
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(type(m).forward is m.forward.__func__ for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        ac_policies.apply_policy(model, "full").remove()  # applying again after undo works


def test_hf_gradient_checkpointing_is_refused():
    model = tiny_ac_model("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    # the release's own names: activation_checkpointing on 5.25, gradient_checkpointing before
    disable = "activation" if hasattr(model, "activation_checkpointing_disable") else "gradient"
    with pytest.raises(ValueError, match=f"{disable}_checkpointing=False.*model.{disable}_checkpointing_disable"):
        ac_policies.apply_policy(model, "full")
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_kv_cache_in_training_is_written_once(family):
    """With use_cache=True in training, the cache is filled once and matches no checkpointing."""
    model = model_of(family)
    ids = token_batch(s=10)
    ref = model(input_ids=ids, use_cache=True).cache
    with ac_policies.apply_policy(model, "non_moe"):
        out = model(input_ids=ids, labels=ids, use_cache=True)
        out.loss.backward()  # the recompute must not write the cache again
    assert out.cache.get_seq_length() == ref.get_seq_length() == 10
    for a, b in zip(out.cache.layers, ref.layers):
        for attr in ("keys", "values", "recurrent_states", "conv_states"):
            if isinstance(getattr(b, attr, None), torch.Tensor):
                torch.testing.assert_close(getattr(a, attr), getattr(b, attr))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_prefilled_kv_cache_in_training_is_refused(family):
    model = model_of(family)
    with torch.no_grad():
        cache = model(input_ids=token_batch(s=4), use_cache=True).cache
    with ac_policies.apply_policy(model, "non_moe"):
        with pytest.raises(ValueError, match=r"already holds 4 token\(s\).*use_cache=False"):
            model(input_ids=token_batch(s=6), labels=token_batch(s=6), cache=cache, use_cache=True)
        with torch.no_grad():  # without gradients nothing is checkpointed; decoding works
            model(input_ids=token_batch(s=1), cache=cache, use_cache=True)


def test_dropout_rng_is_replayed_in_recompute():
    """With attention dropout on, recompute replays the same mask (RNG state preserved)."""
    model = tiny_ac_model("qwen3_moe", attention_dropout=0.3)
    model.config._attn_implementation = "eager"
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    loss_b, _ = loss_and_grads(model, ids)
    assert loss_b == loss0  # same seed, same mask: the reference is reproducible
    with ac_policies.apply_policy(model, "non_moe"):
        loss1, grads1 = loss_and_grads(model, ids)
    assert loss1 == loss0
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7)


def test_moe_checkpointing_warns_once_and_non_moe_does_not():
    model = model_of("mixtral")
    with pytest.warns(ac_policies.ACPolicyWarning) as record:
        ac_policies.plan(model, "full")
    msgs = [str(w.message) for w in record if "rerun in backward" in str(w.message)]
    assert len(msgs) == 1 and "2 MoE block(s)" in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ac_policies.plan(model, "non_moe")


MOE_SELECTIVE_TABLE = [  # the bench's "non_moe + selective MoE" table, as config data
    {"when": "moe", "action": "selective", "ops": ["mm", "addmm", "_grouped_mm"], "on_unmatched": "error"},
    {"when": {"inside": "moe"}, "action": "none"},
    *ac_policies.PRESETS["non_moe"].to_dicts()[1:],
]


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("family", [f for f in AC_MOE_FAMILIES if f != "gpt_oss"])
def test_moe_selective_table_keeps_gradients_and_reruns_no_moe_matmul(family):
    from ac_policies.measure import recompute_flops

    model = model_of(family)
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    with ac_policies.apply_policy(model, MOE_SELECTIVE_TABLE):
        loss1, grads1 = loss_and_grads(model, ids)
        _, moe_flops = recompute_flops(model, lambda: model(input_ids=ids, labels=ids).loss, recognised(model, "moe"))
    assert moe_flops == 0
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_moe_selective_table_on_gpt_oss_fails_loudly():
    """GPT-OSS adds its expert bias into the grouped-GEMM output in place: saving it cannot work."""
    model = model_of("gpt_oss")
    with ac_policies.apply_policy(model, MOE_SELECTIVE_TABLE):
        with pytest.raises(RuntimeError, match="mutated"):
            model(input_ids=token_batch(), labels=token_batch()).loss.backward()
