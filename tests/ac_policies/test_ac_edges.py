"""Edges a training loop hits: Hugging Face checkpointing on top of a policy (either order),
keyword arguments with checkpoint's own option names, eval with a KV cache, and caches that
this forward created empty, for every cache layer type Transformers ships."""

from __future__ import annotations

import warnings

import pytest
import torch

import ac_policies
from ac_policies.kv_cache import held_tokens
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model


def _hf_enable(model) -> None:
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def _hf_disable(model) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


@pytest.fixture(scope="module")
def llama():
    return tiny_ac_model("llama", use_cache=False)


@pytest.mark.parametrize("table", ["full", [{"match": "*", "when": "attention", "action": "checkpoint"}]])
def test_double_checkpointing_is_refused_in_both_orders_with_one_message(llama, table):
    ids = token_batch()
    calls = []
    hook = llama.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        # policy first, then Hugging Face's checkpointing: refused at the next training forward
        handle = ac_policies.apply_policy(llama, table)
        _hf_enable(llama)
        with pytest.raises(ValueError, match="checkpointing twice") as after:
            llama(input_ids=ids, labels=ids).loss.backward()
        llama.eval()  # neither checkpoints in eval: no refusal there
        with torch.no_grad():
            llama(input_ids=ids)
        llama.train()
        handle.remove()
        # Hugging Face's first, then the policy: refused by apply_policy, model untouched
        with pytest.raises(ValueError, match="checkpointing twice") as before:
            ac_policies.apply_policy(llama, table)
        assert not any("forward" in m.__dict__ for m in llama.modules())
        _hf_disable(llama)
        assert str(after.value) == str(before.value)  # one message, naming the flagged layer and both fixes
        assert "model.layers.0" in str(before.value) and "gradient_checkpointing_disable" in str(before.value)
        with ac_policies.apply_policy(llama, table):  # the policy alone works again
            calls.clear()
            llama(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == 2  # forward + one recompute, never two
    finally:
        hook.remove()
        _hf_disable(llama)


class _Kwargs(torch.nn.Module):
    """Records the keyword arguments it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: list[dict] = []

    def forward(self, x, **kwargs):
        self.seen.append(dict(kwargs))
        scale = 2.0 if kwargs.get("debug") else 1.0
        return self.lin(x) * scale


NAMES = {"debug": True, "early_stop": False, "function": "f", "use_reentrant": True, "context_fn": None,
         "preserve_rng_state": False, "determinism_check": "none", "args": 1, "kwargs": 2, "fn": 3}


@pytest.mark.parametrize("action", ["checkpoint", "selective", "offload"])
def test_keyword_arguments_named_like_checkpoint_options_reach_the_module(action):
    model = torch.nn.Sequential(_Kwargs())
    x = torch.randn(3, 4, requires_grad=True)
    with ac_policies.apply_policy(model, [{"match": "0", "action": action}]):
        out = model[0](x, **NAMES)
        out.sum().backward()
    assert model[0].seen[0] == NAMES  # forward
    assert all(seen == NAMES for seen in model[0].seen)  # and any recompute
    torch.testing.assert_close(x.grad, 2.0 * model[0].lin.weight.sum(0).expand(3, 4))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_eval_with_gradients_decodes_with_a_cache(family):
    """A two-step cached decode in eval mode with grad on: no region is entered, logits unchanged."""
    model = tiny_ac_model(family)
    model.eval()
    ids, nxt = token_batch(s=6), token_batch(seed=1, s=1)

    def decode():
        first = model(input_ids=ids, use_cache=True)
        second = model(input_ids=nxt, cache=first.cache, use_cache=True)
        return first.logits, second.logits

    ref = decode()
    with ac_policies.apply_policy(model, "non_moe"), torch.enable_grad():
        got = decode()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("preset", ["full", "non_moe"])
def test_qwen3_next_trains_with_use_cache_at_its_default(preset):
    """Qwen3-Next builds an empty hybrid cache (linear + full attention layers) in training: no refusal."""
    model = tiny_ac_model("qwen3_next")
    assert model.config.use_cache is True
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    with ac_policies.apply_policy(model, preset):
        loss1, grads1 = loss_and_grads(model, ids)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7)


def _layer_kinds():
    cu = pytest.importorskip("transformers.cache_utils")
    kinds = {
        "DynamicLayer": lambda: cu.DynamicLayer(),
        "DynamicSlidingWindowLayer": lambda: cu.DynamicSlidingWindowLayer(sliding_window=4),
        "StaticLayer": lambda: cu.StaticLayer(max_cache_len=8),
        "StaticSlidingWindowLayer": lambda: cu.StaticSlidingWindowLayer(max_cache_len=8, sliding_window=4),
        "LinearAttentionLayer": lambda: cu.LinearAttentionLayer(),
        "LinearAttentionAndFullAttentionLayer": lambda: cu.LinearAttentionAndFullAttentionLayer(),
        "LinearAttentionAndSlidingWindowAttentionLayer": lambda: cu.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=4),
        "DummyLayer": lambda: cu.DummyLayer(),
    }
    return kinds


class _Cache:
    def __init__(self, layer) -> None:
        self.layers = [layer]


@pytest.mark.parametrize("kind", list(_layer_kinds()))
def test_every_cache_layer_type_reads_empty_then_held(kind):
    layer = _layer_kinds()[kind]()
    assert held_tokens(_Cache(layer), 0) == 0  # fresh: checkpointing may fill it once
    kv = torch.randn(1, 2, 3, 4)
    writes = []
    if hasattr(layer, "update_conv_state"):
        writes.append(lambda: layer.update_conv_state(torch.randn(1, 6, 3), conv_kernel_size=4))
    if kind != "DummyLayer" and kind != "LinearAttentionLayer":
        writes.append(lambda: layer.update(kv, kv))
    for write in writes:
        write()
        assert held_tokens(_Cache(layer), 0) == 3, kind  # 3 tokens written: refused from now on
    if hasattr(layer, "update_recurrent_state"):
        fresh = _layer_kinds()[kind]()
        fresh.update_recurrent_state(torch.randn(1, 2, 4, 4))
        assert held_tokens(_Cache(fresh), 0) is None  # recurrent state without a count: refused


@pytest.mark.parametrize("family", ["qwen3_next"])
def test_a_cache_that_held_tokens_before_the_step_is_still_refused(family):
    model = tiny_ac_model(family)
    with torch.no_grad():
        cache = model(input_ids=token_batch(s=4), use_cache=True).cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        handle = ac_policies.apply_policy(model, "full")
    with handle, pytest.raises(ValueError, match=r"already holds 4 token\(s\) for layer 0.*model.eval\(\)"):
        model(input_ids=token_batch(s=6), labels=token_batch(s=6), cache=cache, use_cache=True)
