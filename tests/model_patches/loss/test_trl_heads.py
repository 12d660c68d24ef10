"""TRL's fused LM head and chunked divergence routed through functional_ce (``enable_trl_heads``).

Kernel-level parity with TRL's own kernel (every ``outputs`` combination, temperature, soft-cap,
logit scale, bias, bf16, gradients), the model-level ``FusedCausalLMOutput`` contract, the
divergence for beta 0 / 0.5 / 1 with and without each model's soft-cap, the handles (undo,
reference counts, refusal mode), and real ``trl.SFTTrainer`` runs on a tiny random Llama: the
routed run calls functional_ce and logs the losses of a plain TRL run. Chunks run eagerly here
(compiled chunk graphs are tested in tests/functional_ce).
"""

from __future__ import annotations

import itertools

import pytest
import torch

trl = pytest.importorskip("trl")

import trl.trainer.distillation_trainer as distillation_module  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

import functional_ce  # noqa: E402
import model_patches  # noqa: E402
from model_patches.loss import trl_heads  # noqa: E402
from tests.support.tiny_models import tiny_loss_model  # noqa: E402

OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FIELDS = ("log_probs", *OPTIONAL)
TRL_HEAD = trl_utils._ChunkedLogProbFunction
TRL_DIVERGENCE = distillation_module._chunked_divergence_loss


@pytest.fixture(autouse=True)
def _eager_chunks_and_no_leftover_handles(monkeypatch):
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")
    yield
    assert not trl_heads.trl_heads_routed()
    assert trl_utils._ChunkedLogProbFunction is TRL_HEAD
    assert distillation_module._chunked_divergence_loss is TRL_DIVERGENCE


def _head(seed, n=40, h=24, v=157, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5 * 3).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    logits = hidden.float() @ weight.float().T + (0 if b is None else b.float())
    targets[::3] = logits[::3].argmax(-1)  # some labels are the arg-max: is_top1 True there
    return hidden, weight, b, targets


def _run(apply, inputs, args, seed=0):
    """Outputs and the gradients of a seeded combination of the log-probs and the entropy."""
    leaves = [None if t is None else t.clone().requires_grad_(t.is_floating_point()) for t in inputs[:3]]
    out = apply(*leaves, inputs[3], *args)
    g = torch.Generator().manual_seed(seed)
    loss = (out[0] * torch.randn(out[0].shape, generator=g)).sum()
    if out[1] is not None:
        loss = loss + (out[1] * torch.randn(out[1].shape, generator=g)).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return out, grads


def _assert_like_trl(got, want, rtol=1e-5, grad_rtol=1e-5, atol=0.0):
    (out, grads), (ref, ref_grads) = got, want
    for name, a, b in zip(FIELDS, out, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        if b.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            err = (a - b).abs().max().item()
            assert err <= rtol * (1 + b.abs().max().item()) + atol, f"{name}: {err:.3g}"
        assert a.requires_grad == b.requires_grad, name
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        err = (a.float() - b.float()).abs().max().item()
        assert err <= grad_rtol * (1 + b.float().abs().max().item()), f"gradient: {err:.3g}"


SUBSETS = [tuple(s) for k in range(len(OPTIONAL) + 1) for s in itertools.combinations(OPTIONAL, k)]


@pytest.mark.parametrize("extra", SUBSETS, ids=["+".join(s) or "log_probs" for s in SUBSETS])
def test_every_outputs_combination_matches_trls_kernel(extra):
    inputs = _head(1)
    args = (1.0, 64, None, 1.0, ("log_probs", *extra))
    _assert_like_trl(_run(trl_heads.routed_logprobs, inputs, args), _run(ChunkedLogProbFunction.apply, inputs, args))


@pytest.mark.parametrize("temperature, softcap, logit_scale, bias", [
    (0.7, None, 1.0, True), (1.0, 5.0, 1.0, False), (1.3, 4.0, 0.25, True), (0.9, None, 2.5, False),
])
def test_temperature_softcap_and_logit_scale_match_trls_kernel(temperature, softcap, logit_scale, bias):
    inputs = _head(2, bias=bias)
    args = (temperature, 50, softcap, logit_scale, ("log_probs", *OPTIONAL))
    # relative to the tempered logits' size: the entropy is lse - E[z], each rounded in fp32
    logits = inputs[0] @ inputs[1].T + (0 if inputs[2] is None else inputs[2])
    size = (logits * logit_scale / temperature).abs().max().item() if softcap is None else softcap / temperature
    _assert_like_trl(_run(trl_heads.routed_logprobs, inputs, args), _run(ChunkedLogProbFunction.apply, inputs, args),
                     rtol=1e-5 * max(1.0, size / 4))


def test_bf16_head_matches_trls_kernel_to_bf16_rounding():
    inputs = _head(3, dtype=torch.bfloat16)
    args = (1.0, 64, None, 1.0, ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"))
    got, want = _run(trl_heads.routed_logprobs, inputs, args), _run(ChunkedLogProbFunction.apply, inputs, args)
    # both round each logit to bf16 (a matmul of another blocking) before their fp32 statistics:
    # a bf16 rounding of the largest logits (2**-8 relative) apart
    size = (inputs[0].float() @ inputs[1].float().T + inputs[2].float()).abs().max().item()
    _assert_like_trl(got, want, rtol=4e-3, grad_rtol=2e-2, atol=2 ** -8 * size)


def test_fp32_hidden_states_with_a_bf16_head_as_cast_lm_head_to_fp32_passes_them():
    hidden, weight, bias, targets = _head(4, dtype=torch.bfloat16)
    inputs = (hidden.float(), weight, bias, targets)
    args = (1.0, 64, None, 1.0, ("log_probs", "entropy"))
    _assert_like_trl(_run(trl_heads.routed_logprobs, inputs, args), _run(ChunkedLogProbFunction.apply, inputs, args),
                     grad_rtol=1e-2)


def _fused_outputs(model, batch, routed):
    model.zero_grad()
    handle = model_patches.enable_trl_heads() if routed else None
    try:
        out = model(**batch, fused_lm_head=True)
        loss = out.loss + 0.1 * out.entropy.sum()
        loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out, grads


def test_model_level_fused_output_with_ignored_labels_matches_trl():
    """add_fused_lm_head on a real tiny Llama: every FusedCausalLMOutput field and dtype, zeros
    at ignored labels, the loss and every parameter's gradient."""
    model = tiny_loss_model("llama", vocab_size=128)
    trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", *OPTIONAL))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (3, 17), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[2, 10:] = -100
    batch = {"input_ids": ids, "labels": labels}
    (out, grads), (ref, ref_grads) = _fused_outputs(model, batch, True), _fused_outputs(model, batch, False)
    for name in ("loss", *FIELDS, "label_mask"):
        a, b = getattr(out, name), getattr(ref, name)
        assert a.dtype == b.dtype, name
        if b.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), name
    assert (out.log_probs[~out.label_mask] == 0).all() and not out.is_top1[~out.label_mask].any()
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * (1 + b.abs().max().item()))


def _divergence_inputs(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, k, hs, ht, v = 2, 9, 16, 24, 131
    mask = (torch.rand(b, k, generator=g) < 0.7).long()
    return dict(
        student_hidden_states=torch.randn(b, k, hs, generator=g).to(dtype),
        teacher_hidden_states=torch.randn(b, k, ht, generator=g).to(dtype),
        student_lm_head_weight=(torch.randn(v, hs, generator=g) / 2).to(dtype),
        teacher_lm_head_weight=(torch.randn(v, ht, generator=g) / 2).to(dtype),
        completion_mask=mask,
        student_lm_head_bias=torch.randn(v, generator=g).to(dtype),
        teacher_lm_head_bias=None,
    )


def _divergence(fn, inputs, **kw):
    leaves = {k: (v.clone().requires_grad_() if k.startswith("student") and v is not None else v)
              for k, v in inputs.items()}
    loss, entropy_sum, n_valid = fn(**leaves, **kw)
    names = [k for k in leaves if k.startswith("student") and leaves[k] is not None]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names])
    return (loss, entropy_sum, n_valid), grads


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature, scales, count", [(1.0, (1.0, 1.0), None), (1.7, (0.5, 2.0), 11)])
@pytest.mark.parametrize("softcaps", [(None, None), (3.0, None), (None, 2.5), (4.0, 2.0)],
                         ids=["uncapped", "student-capped", "teacher-capped", "both-capped"])
def test_divergence_matches_trls_for_beta_temperature_and_softcaps(beta, temperature, scales, count, softcaps):
    inputs = _divergence_inputs(int(beta * 10) + int(temperature * 10))
    kw = dict(beta=beta, temperature=temperature, num_items_in_batch=None if count is None else torch.tensor(count),
              student_logit_scale=scales[0], teacher_logit_scale=scales[1],
              student_final_logit_softcapping=softcaps[0], teacher_final_logit_softcapping=softcaps[1])
    (got, grads), (want, ref_grads) = _divergence(trl_heads.routed_divergence, inputs, **kw), _divergence(
        TRL_DIVERGENCE, inputs, **kw)
    assert torch.equal(got[2], want[2]) and got[2].dtype == want[2].dtype
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)
    assert not got[1].requires_grad
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()))


def test_divergence_as_the_trainer_calls_it_routes_through_functional_ce(monkeypatch):
    calls = []
    real = functional_ce.linear_distillation_loss
    monkeypatch.setattr(functional_ce, "linear_distillation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = _divergence_inputs(5)
    with model_patches.enable_trl_heads():
        # the trainer calls the module global by name, with these keywords
        got = distillation_module._chunked_divergence_loss(
            inputs["student_hidden_states"], inputs["teacher_hidden_states"], inputs["student_lm_head_weight"],
            inputs["teacher_lm_head_weight"], inputs["completion_mask"], 0.5, num_items_in_batch=None,
            student_lm_head_bias=inputs["student_lm_head_bias"], teacher_lm_head_bias=None, student_logit_scale=1.0,
            teacher_logit_scale=1.0, student_final_logit_softcapping=None, teacher_final_logit_softcapping=None,
            temperature=1.0)
        capped = distillation_module._chunked_divergence_loss(
            **inputs, beta=0.5, student_final_logit_softcapping=3.0, teacher_final_logit_softcapping=2.0)
    assert calls == [1, 1]
    want = TRL_DIVERGENCE(**inputs, beta=0.5)
    assert torch.allclose(got[0], want[0], rtol=1e-5)
    want = TRL_DIVERGENCE(**inputs, beta=0.5, student_final_logit_softcapping=3.0, teacher_final_logit_softcapping=2.0)
    assert torch.allclose(capped[0], want[0], rtol=1e-5)


def test_handles_undo_refcount_and_refusal_mode():
    first = model_patches.enable_trl_heads()
    second = model_patches.enable_trl_heads()
    assert trl_heads.trl_heads_routed() and "active" in repr(first)
    assert type(trl_utils._ChunkedLogProbFunction).__name__ == "RoutedChunkedLogProb"
    assert trl_utils._ChunkedLogProbFunction.__wrapped__ is TRL_HEAD
    assert trl_utils._ChunkedLogProbFunction.forward is TRL_HEAD.forward  # other attributes pass through
    assert distillation_module._chunked_divergence_loss.__wrapped__ is TRL_DIVERGENCE
    rows = model_patches.trl_heads_status()
    assert [r.state for r in rows] == ["applied", "applied"] and "2 live handle(s)" in rows[0].reason
    first.remove()
    assert trl_heads.trl_heads_routed() and trl_utils._ChunkedLogProbFunction is not TRL_HEAD
    second.remove()
    second.remove()  # twice: a no-op
    assert not trl_heads.trl_heads_routed() and trl_utils._ChunkedLogProbFunction is TRL_HEAD
    assert [r.state for r in model_patches.trl_heads_status()] == ["available", "available"]

    inputs = _head(6)
    refusal = trl_heads.refuse_unrouted_trl_heads("the chunked loss is on and TRL's head would bypass it")
    with pytest.raises(ValueError, match="would bypass it"):
        trl_utils._ChunkedLogProbFunction.apply(*inputs, 1.0, 64)
    with pytest.raises(ValueError, match="would bypass it"):
        distillation_module._chunked_divergence_loss(**_divergence_inputs(0), beta=0.5)
    assert "refusing" in model_patches.trl_heads_status()[0].reason
    with model_patches.enable_trl_heads():  # routed mode overrides the refusal
        out = trl_utils._ChunkedLogProbFunction.apply(*inputs, 1.0, 64)
        assert out[0].shape == (40,) and all(t is not None for t in out)  # TRL's default: every output
    with pytest.raises(ValueError, match="would bypass it"):
        trl_utils._ChunkedLogProbFunction.apply(*inputs, 1.0, 64)
    refusal.remove()
    assert trl_utils._ChunkedLogProbFunction is TRL_HEAD
    with pytest.raises(TypeError, match="message"):
        trl_heads.refuse_unrouted_trl_heads("")


def test_a_trl_kernel_of_another_signature_is_refused_loudly(monkeypatch):
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", type("Other", (), {
        "apply": staticmethod(lambda *a: None), "forward": staticmethod(lambda ctx, hidden, weight: None)}))
    with pytest.raises(model_patches.PatchError, match="trl 1.16"):
        model_patches.enable_trl_heads()
    assert distillation_module._chunked_divergence_loss is TRL_DIVERGENCE  # nothing half-applied
    handle = model_patches.enable_trl_heads(strict=False)  # a logged warning, that record left out
    assert [r.state for r in handle.rows] == ["failed", "applied"]
    handle.remove()
    monkeypatch.undo()


def test_without_trl_the_records_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(trl_heads, "_trl_version", lambda: None)
    handle = model_patches.enable_trl_heads()
    refusal = trl_heads.refuse_unrouted_trl_heads("x")
    assert all(r.state == "skipped" and "not installed" in r.reason for r in model_patches.trl_heads_status())
    assert all(r.state == "skipped" for r in handle.rows) and handle.active and refusal.active
    handle.remove()
    refusal.remove()
    assert "removed" in repr(handle)


# --- a real SFTTrainer ---------------------------------------------------------------------------


def _sft_trainer(tmp_path, layout="padded"):
    from bench.harness.trainers import SFT_LAYOUTS, sft_trainer, token_rows

    rows = token_rows(12, 40, ragged=True)
    return sft_trainer(tiny_loss_model("llama", vocab_size=128), tmp_path, rows, **{"max_length": 64,
                       **SFT_LAYOUTS[layout]})


def _losses(trainer):
    from bench.harness.trainers import logged

    return logged(trainer, "loss", "entropy", "mean_token_accuracy")


@pytest.mark.parametrize("layout", ["padded", "packing", "padding_free"])
def test_sft_trainer_routes_in_either_order_and_logs_trls_losses(tmp_path, monkeypatch, layout):
    calls = []
    real = functional_ce.linear_token_logprobs
    monkeypatch.setattr(functional_ce, "linear_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = _losses(_sft_trainer(tmp_path / "plain", layout))
    assert calls == []

    with model_patches.enable_trl_heads():  # enabled before the trainer adds its head
        before = _losses(_sft_trainer(tmp_path / "before", layout))
    n_before = len(calls)
    assert n_before >= 3  # one call per step at least

    trainer = _sft_trainer(tmp_path / "after", layout)
    with model_patches.enable_trl_heads():  # enabled after
        after = _losses(trainer)
    assert len(calls) - n_before == n_before

    assert len(plain) == len(before) == len(after) == 3
    for routed in (before, after):
        for got, want in zip(routed, plain):
            for a, b in zip(got, want):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (routed, plain)
