"""PEFT (LoRA) is a supported client: every patch on a ``PeftModel`` or on its base model, applied
before or after ``get_peft_model``, gives stock PEFT's losses and LoRA gradients, and the library's
path is really taken (counted). ``plan()`` finds the blocks under PEFT's names, PEFT's own gradient
checkpointing is refused next to a policy, ``merge_and_unload()`` and ``save_pretrained`` give
stock's tensors, and ``SFTTrainer(peft_config=...)`` trains to stock PEFT's losses.

LoRA's ``B`` starts random here (``init_lora_weights=False``), so every LoRA matrix gets a gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ac_policies
import functional_ce
import model_patches
from tests.support.batches import packed_batch, padded_batch
from tests.support.tiny_models import tiny_loss_model

peft = pytest.importorskip("peft")

#: family -> the preset that fits it (MoE: leave the experts alone)
PRESET = {"llama": "full", "qwen3_moe": "non_moe"}
PATCHES = ("hidden_state_loss", "policy", "chunked_loss", "all")
ORDERS = ("on_peft_model", "on_base_model", "before_get_peft_model")


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Calls of what each patch runs: functional_ce's losses, and the policy's checkpoint regions."""
    import ac_policies.apply as policy_apply

    calls = {"linear_cross_entropy": 0, "cross_entropy": 0, "linear_token_logprobs": 0, "checkpoint": 0}

    def counting(owner, name):
        real = getattr(owner, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, count)

    counting(functional_ce, "linear_cross_entropy")
    counting(functional_ce, "cross_entropy")
    counting(functional_ce, "linear_token_logprobs")
    counting(policy_apply, "checkpoint")
    return calls


def _apply(target: torch.nn.Module, patches: str, family: str) -> list:
    handles = []
    if patches in ("hidden_state_loss", "all"):
        handles.append(model_patches.enable_linear_cross_entropy(target))
    if patches in ("policy", "all"):
        handles.append(ac_policies.apply_policy(target, PRESET[family]))
    if patches == "chunked_loss":
        handles.append(model_patches.enable_chunked_loss(model=target))
    return handles


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n and g is not None for n, g in grads.items())
    return grads


@pytest.mark.parametrize("family", sorted(PRESET))
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("patches", PATCHES)
def test_every_patch_on_a_peft_model_or_its_base_gives_stock_peft(family, order, patches, counted):
    batch = padded_batch(seed=3)
    stock = _lora(tiny_loss_model(family))
    expected = stock(**batch).loss
    expected.backward()
    expected_grads = _lora_grads(stock)

    base = tiny_loss_model(family)
    handles = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        if order == "before_get_peft_model":
            handles = _apply(base, patches, family)
            model = _lora(base)
        else:
            model = _lora(base)
            handles = _apply(model if order == "on_peft_model" else model.get_base_model(), patches, family)
    out = model(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=0)
    grads = _lora_grads(model)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5 * float(expected_grads[name].abs().max()),
                                   msg=name)
    # the library's path ran
    uses_hidden = patches in ("hidden_state_loss", "all")
    assert (out.logits is None) == uses_hidden
    assert (counted["linear_cross_entropy"] > 0) == uses_hidden
    assert (counted["cross_entropy"] > 0) == (patches == "chunked_loss")
    assert (counted["checkpoint"] > 0) == (patches in ("policy", "all"))
    for handle in reversed(handles):
        handle.remove()
    assert model(**batch).logits is not None


@pytest.mark.parametrize("family", sorted(PRESET))
def test_packed_documents_stay_apart_through_a_peft_model(family):
    model = _lora(tiny_loss_model(family, attn_implementation="sdpa"))
    packed = packed_batch((5, 7, 4))
    ids, positions = packed["input_ids"], packed["position_ids"]
    mask = torch.cat([torch.full((n,), k + 1) for k, n in enumerate((5, 7, 4))]).unsqueeze(0)
    with torch.no_grad(), model_patches.enable_packing():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        start = 0
        for n in (5, 7, 4):
            alone = model(input_ids=ids[:, start:start + n]).logits
            torch.testing.assert_close(logits[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


@pytest.mark.parametrize("family", sorted(PRESET))
def test_plan_finds_the_blocks_under_peft_names(family):
    model = _lora(tiny_loss_model(family))
    rows = ac_policies.plan(model, PRESET[family]).wrapped
    layers = model.get_base_model().config.num_hidden_layers
    assert rows and all(r.fqn.startswith("base_model.model.model.") for r in rows)
    in_layers = [r.fqn for r in rows if r.fqn.startswith("base_model.model.model.layers.")]
    assert {fqn.split(".")[4] for fqn in in_layers} == {str(i) for i in range(layers)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        handle = ac_policies.apply_policy(model, PRESET[family])
    assert ac_policies.policy_of(model).plan == handle.plan and len(handle.plan.wrapped) == len(rows)


def _peft_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing as PEFT users switch it on: through the PeftModel, which hands it to
    the base model and makes the inputs require gradients (what TRL does with a peft_config too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name, still what PEFT's docs call
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def test_peft_gradient_checkpointing_next_to_a_policy_is_refused_in_either_order():
    batch = padded_batch()
    model = _lora(tiny_loss_model("llama"))
    _peft_checkpointing(model)
    with pytest.raises(ValueError, match="activation checkpointing twice"):
        ac_policies.apply_policy(model, "full")

    model = _lora(tiny_loss_model("llama"))
    ac_policies.apply_policy(model, "full")
    _peft_checkpointing(model)
    with pytest.raises(ValueError, match="activation checkpointing twice"):
        model(**batch)


def test_merge_and_unload_and_save_pretrained_give_stock_tensors(tmp_path):
    from safetensors.torch import load_file

    stock = _lora(tiny_loss_model("llama"))
    model = _lora(tiny_loss_model("llama"))
    model_patches.enable_linear_cross_entropy(model.get_base_model())
    ac_policies.apply_policy(model, "full")
    model(**padded_batch()).loss.backward()  # the patched path ran (no step: the adapters stay stock's)
    stock.save_pretrained(tmp_path / "stock")
    model.save_pretrained(tmp_path / "patched")
    saved = [load_file(tmp_path / name / "adapter_model.safetensors") for name in ("stock", "patched")]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    merged = [m.merge_and_unload().state_dict() for m in (stock, model)]
    assert merged[0].keys() == merged[1].keys()
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


def test_sft_trainer_with_peft_config_gives_stock_peft_losses(tmp_path, counted):
    """SFTTrainer(peft_config=...): TRL wraps the model itself. A policy on the base model, packing
    and TRL's heads routed through functional_ce train to stock PEFT's losses and adapters; the
    hidden-state loss is refused with the fix, since TRL's own fused head computes the loss."""
    pytest.importorskip("trl")
    from ac_policies.apply import trainer_checkpointing_argument
    from bench.harness.trainers import logged_losses, sft_trainer, token_rows

    rows = token_rows(12, 16, ragged=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    no_hf_checkpointing = {trainer_checkpointing_argument(): False}

    def trainer(model, name):
        torch.manual_seed(0)
        return sft_trainer(model, tmp_path / name, rows, peft_config=config, packing=True, **no_hf_checkpointing)

    stock = trainer(tiny_loss_model("llama", attn_implementation="sdpa"), "stock")
    expected = logged_losses(stock)

    base = tiny_loss_model("llama", attn_implementation="sdpa")
    with model_patches.enable_packing(), model_patches.enable_trl_heads(), ac_policies.apply_policy(base, "full"):
        patched = trainer(base, "patched")
        losses = logged_losses(patched)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert counted["checkpoint"] > 0 and counted["linear_token_logprobs"] > 0  # the policy and the routed head ran
    stock_adapters = {n: p for n, p in stock.model.named_parameters() if "lora_" in n}
    for name, p in patched.model.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(p, stock_adapters[name], rtol=1e-5, atol=1e-6, msg=name)

    refused = tiny_loss_model("llama")
    model_patches.enable_linear_cross_entropy(refused)
    with pytest.raises(ValueError, match="enable_trl_heads"):
        trainer(refused, "refused").train()
