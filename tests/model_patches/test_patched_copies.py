"""A patched model stays the user's model: ``copy.deepcopy`` (TRL's reference models, EMA and teacher
copies) and pickling (``torch.save(model)``) give an independent model, patched the same way, that
runs its own weights, fills its own gradients, and carries handles of its own.

The oracle for a copy is a model built identically, never trained, with the same patches applied
afresh: after the original takes optimizer steps, the copy's losses equal that model's bit for bit.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch

import ac_policies
import model_patches
from ac_policies.apply import PolicyForward
from model_patches.loss.linear_cross_entropy import LinearCrossEntropyForward
from tests.support.tiny_models import LOSS_VOCAB, tiny_loss_model

#: (family, overrides): dense, tied embeddings (with Gemma 2's soft-capped head), MoE.
MODELS = {
    "llama": ("llama", {}),
    "tied": ("gemma2", {}),
    "moe": ("qwen3_moe", {}),
}
#: the patches of one case: the hidden-state loss, a preset, or both.
PATCHES = [("hidden_state_loss", None), (None, "full"), (None, "selective"), (None, "op_sac"), (None, "keep_router"),
           ("hidden_state_loss", "full"), (None, "non_moe"), (None, "non_moe_no_attn"), ("hidden_state_loss", "non_moe")]
CASES = [(m, loss, preset) for m in MODELS for loss, preset in PATCHES if m == "moe" or preset not in ("non_moe", "non_moe_no_attn")]


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, LOSS_VOCAB, (2, 12), generator=g)
    return dict(input_ids=ids, labels=ids)


def _patched(name: str, loss: str | None, preset: str | None, policy_first: bool = False) -> torch.nn.Module:
    family, overrides = MODELS[name]
    model = tiny_loss_model(family, **overrides)

    def policy() -> None:
        if preset:
            with warnings.catch_warnings():  # the MoE model under 'full' is told its experts are recomputed
                warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
                ac_policies.apply_policy(model, preset)

    if policy_first:
        policy()
    if loss:
        model_patches.enable_linear_cross_entropy(model)
    if not policy_first:
        policy()
    return model


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """One SGD step on ``model``; its loss before the step."""
    loss = model(**batch).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.zero_grad(set_to_none=True)
    return loss.item()


def _check_patched_the_same_way(copy_: torch.nn.Module, loss: str | None, preset: str | None) -> None:
    found = model_patches.handles(copy_)
    assert len(found) == (1 if loss else 0) and all(h.active for h in found)
    policy = ac_policies.policy_of(copy_)
    assert (policy is not None and policy.active and policy.plan.policy.name == preset) if preset else policy is None
    for m in copy_.modules():  # every wrapper is bound to the copy's own modules
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, PolicyForward):
            assert fwd.module is m
        if isinstance(fwd, LinearCrossEntropyForward):
            assert fwd.model is copy_ is m


def _copies(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(model), "pickle": torch.load(buffer, weights_only=False)}


@pytest.mark.parametrize("name,loss,preset,policy_first",
                         [(*case, False) for case in CASES] + [("llama", "hidden_state_loss", "full", True),
                                                               ("moe", "hidden_state_loss", "non_moe", True)])
def test_a_copy_runs_its_own_weights_and_is_patched_the_same_way(name, loss, preset, policy_first):
    original = _patched(name, loss, preset, policy_first)
    fresh = _patched(name, loss, preset, policy_first)  # identical weights, never trained, patched afresh
    copies = _copies(original)
    batch = _batch()
    for _ in range(2):
        _step(original, batch)
    expected = [_step(fresh, batch) for _ in range(2)]
    for how, c in copies.items():
        _check_patched_the_same_way(c, loss, preset)
        assert [_step(c, batch) for _ in range(2)] == expected, how
        # the copy's backward fills only its own gradients
        c(**batch).loss.backward()
        assert all(p.grad is None for p in original.parameters()), how
        assert sum(p.grad is not None for p in c.parameters()) == sum(p.requires_grad for p in c.parameters()), how


@pytest.mark.parametrize("name,loss,preset", [("llama", "hidden_state_loss", "full"), ("moe", "hidden_state_loss", "non_moe")])
def test_removing_either_model_handles_leaves_the_other_patched(name, loss, preset):
    original = _patched(name, loss, preset)
    c = copy.deepcopy(original)
    batch = _batch()
    for first, second in ((original, c), (c, original)):
        for h in model_patches.handles(first):
            h.remove()
        ac_policies.policy_of(first).remove()
        assert model_patches.handles(first) == [] and ac_policies.policy_of(first) is None
        assert "forward" not in first.__dict__ and first(**batch).logits is not None  # stock again
        _check_patched_the_same_way(second, loss, preset)
        assert second(**batch).logits is None  # still the hidden-state loss
        # the first one takes its patches afresh, and the enable refuses the second twice
        model_patches.enable_linear_cross_entropy(first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(first, preset)
        with pytest.raises(ValueError, match="already patched"):
            model_patches.enable_linear_cross_entropy(second)


def test_handles_of_anything_that_holds_a_model():
    model = _patched("llama", "hidden_state_loss", "full")
    holder = types.SimpleNamespace(model=model, ref_model=copy.deepcopy(model), other=3)
    assert len(model_patches.handles(holder)) == 2
    assert ac_policies.policy_of(holder) is not None
    assert model_patches.handles(tiny_loss_model("llama")) == []


def test_a_copy_refuses_a_closure_under_the_patch_at_copy_time():
    for patch in ("loss", "policy"):
        model = tiny_loss_model("llama")
        target = model if patch == "loss" else model.model.layers[0]
        original_forward = target.forward
        target.forward = lambda *a, **k: original_forward(*a, **k)  # code that calls the original
        if patch == "loss":
            model_patches.enable_linear_cross_entropy(model)
        else:
            ac_policies.apply_policy(model, "full")
        with pytest.raises(TypeError, match="closure"):
            copy.deepcopy(model)
        with pytest.raises(TypeError, match="closure"):
            torch.save(model, io.BytesIO())


def test_a_copy_refuses_a_closure_wrapped_on_top_of_the_patch():
    """What Accelerate's mixed precision does at Trainer.train(): model.forward becomes a closure
    that calls the patched forward. A copy would share it, so copying refuses."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    model = tiny_loss_model("llama")
    model_patches.enable_linear_cross_entropy(model)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    with pytest.raises(TypeError, match="installed on top of the patch.*closure"):
        copy.deepcopy(model)
    with pytest.raises((TypeError, AttributeError)):  # pickle refuses the closure itself, as for a stock model
        torch.save(model, io.BytesIO())


def test_a_pickled_model_trains_with_the_same_losses_in_a_fresh_process(tmp_path):
    model = _patched("moe", "hidden_state_loss", "non_moe")
    path = tmp_path / "model.pt"
    torch.save(model, path)
    batch = _batch()
    expected = [_step(model, batch) for _ in range(3)]
    script = textwrap.dedent(f"""
        import torch, ac_policies, model_patches
        torch.set_num_threads({torch.get_num_threads()})  # this process's reductions, in the same order
        from tests.model_patches.test_patched_copies import _batch
        from tests.model_patches.test_patched_copies import _step
        model = torch.load({str(path)!r}, weights_only=False)
        assert len(model_patches.handles(model)) == 1 and ac_policies.policy_of(model).active
        batch = _batch()
        print(repr([_step(model, batch) for _ in range(3)]))
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert eval(out.stdout.strip().splitlines()[-1]) == expected


def test_a_copy_of_a_model_under_the_chunked_loss_is_routed_and_carries_no_orphan_watch():
    """enable_chunked_loss(model=...) routes every model's loss (process-wide) and watches one model:
    a copy computes the routed loss, and the original's watch does not follow it."""
    from model_patches.loss.unused_loss_watch import LossUseWatch

    def watches(m: torch.nn.Module) -> list[LossUseWatch]:
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        return [h.__self__ for h in hooks if isinstance(getattr(h, "__self__", None), LossUseWatch)]

    model = tiny_loss_model("llama")
    batch = _batch()
    with model_patches.enable_chunked_loss(model=model) as handle:
        assert watches(model) and all(w.adopted for w in watches(model))
        assert model_patches.handles(model) == [handle]
        for how, c in _copies(model).items():
            assert model_patches.handles(c) == [], how
            assert watches(c) and not any(w.adopted for w in watches(c)), how  # silent copies of the hooks
            torch.testing.assert_close(c(**batch).loss, model(**batch).loss, rtol=0, atol=0)
    # the hidden-state loss adopts the watch that comes with its copy
    patched = _patched("llama", "hidden_state_loss", None)
    assert all(w.adopted for w in watches(copy.deepcopy(patched)))
