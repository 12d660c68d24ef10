"""model_patches.causal_lm_token_logprobs / causal_lm_distillation_loss on tiny real HF models.

Every value and gradient is compared with an fp64 reference computed from the models' own full
logits (``model(**inputs).logits``, shifted as Transformers shifts labels); the distillation
teacher stays frozen. One FSDP2 run (2 gloo processes) checks both functions on sharded models
against unsharded copies, and the docs' GRPO / GKD snippets are run as written.
"""

from __future__ import annotations

import copy
import pathlib
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model_patches
from model_patches.loss.linear_cross_entropy import VERIFIED_MODEL_TYPES
from tests.support.batches import grads, packed_batch, padded_batch
from tests.support.reference import reference_generalized_jsd, reference_token_logprobs
from tests.support.tiny_models import tiny_loss_model

#: A smaller teacher (hidden size 32) for the different-hidden-size cases.
SMALL = dict(hidden_size=32, intermediate_size=64, head_dim=8)
_NOT_INPUTS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index")


def _inputs(batch: dict) -> dict:
    """The model inputs of a batch; no KV cache (a cache turns off HF's packed-row detection)."""
    return dict({k: v for k, v in batch.items() if k not in _NOT_INPUTS}, use_cache=False)


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def _weights(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(got, want, rtol=1e-4, atol=1e-5, what=""):
    assert got.dtype == torch.float32, got.dtype
    torch.testing.assert_close(got, want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_grads(got: dict, want: dict, rtol=1e-4, atol=1e-6):
    """Each gradient within ``rtol`` of the reference, absolute slack ``atol`` or ``1e-5`` of the
    tensor's largest entry (fp32 summation order over the vocabulary)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name in want:
        slack = max(atol, 1e-5 * float(want[name].abs().max()))
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=slack, msg=lambda m: f"{name}: {m}")


def _biased_head(model: nn.Module, seed: int) -> None:
    old = model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    model.lm_head = head


# ---------------------------------------------------------------- token log-probs


def _logprob_case(model, batch, targets, temperature, **kw):
    """Reference and ours for the weighted sum of log-probs and entropies: values and grads."""
    w_lp, w_ent = _weights(targets.shape, 1), _weights(targets.shape, 2)
    ref_lp, ref_ent = reference_token_logprobs(model(**_inputs(batch)).logits, targets, temperature=temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    ref_grads = grads(model)
    logp, ent = model_patches.causal_lm_token_logprobs(
        model, **batch, temperature=temperature, return_entropy=True, chunk_size=7, **kw
    )
    assert logp.shape == ent.shape == targets.shape
    _assert_close(logp, ref_lp, what="logp")
    _assert_close(ent, ref_ent, what="entropy")
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    _assert_grads(grads(model), ref_grads)
    return logp.detach()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "qwen3_moe"])
def test_token_logprobs_and_entropy_match_the_full_logits(model_type):
    model = tiny_loss_model(model_type)
    batch = padded_batch()
    logp = _logprob_case(model, batch, _shift(batch["labels"]), temperature=0.7)
    ignored = _shift(batch["labels"]) == -100
    assert ignored[:, -1].all() and (logp[ignored] == 0).all()


def test_gemma2_softcap_is_applied_before_the_temperature():
    model = tiny_loss_model("gemma2", final_logit_softcapping=0.1)  # small enough to bite on tiny logits
    assert model.lm_head.weight is model.get_input_embeddings().weight
    batch = padded_batch(seed=3)
    logp = _logprob_case(model, batch, _shift(batch["labels"]), temperature=0.5)
    model.config.final_logit_softcapping = None
    uncapped = model_patches.causal_lm_token_logprobs(model, **batch, temperature=0.5)
    assert not torch.allclose(uncapped, logp, rtol=1e-3)


def test_biased_head_and_temperature_one_without_entropy():
    model = tiny_loss_model("qwen2")  # Qwen2's attention projections have biases; its head has none
    assert model.lm_head.bias is None
    _biased_head(model, seed=0)
    batch = padded_batch(seed=4)
    _logprob_case(model, batch, _shift(batch["labels"]), temperature=1.0)
    only = model_patches.causal_lm_token_logprobs(model, **batch)
    assert isinstance(only, torch.Tensor) and only.dtype == torch.float32


def test_packed_row_with_shift_labels_equals_labels_shifted_inside():
    model = tiny_loss_model("qwen3")
    batch = packed_batch()
    _logprob_case(model, batch, batch["shift_labels"], temperature=1.3)
    padded = padded_batch()
    from_labels = model_patches.causal_lm_token_logprobs(model, **padded)
    as_shift = dict(_inputs(padded), shift_labels=_shift(padded["labels"]))
    torch.testing.assert_close(model_patches.causal_lm_token_logprobs(model, **as_shift), from_labels)


# ---------------------------------------------------------------- distillation


def _distillation_case(student, teacher, batch, counted, *, rtol=1e-4, atol=1e-6, **kw):
    """Reference (TRL's GJSD on both models' full logits) and ours: values, student grads, no
    teacher grads."""
    s_logits = student(**_inputs(batch)).logits
    with torch.no_grad():
        t_logits = teacher(**_inputs(batch)).logits
    ref_kw = {k: v for k, v in kw.items() if k in ("beta", "temperature", "reduction")}
    ref = reference_generalized_jsd(s_logits, t_logits, counted, num_label_tokens=batch.get("num_items_in_batch"),
                                    **ref_kw)
    w = _weights(ref.shape, 5) if ref.dim() else torch.ones(())
    (ref * w).sum().backward()
    ref_grads = grads(student)
    ours = model_patches.causal_lm_distillation_loss(student, teacher, chunk_size=7, **batch, **kw)
    assert ours.shape == ref.shape
    _assert_close(ours, ref, rtol=rtol, atol=atol, what="loss")
    (ours * w).sum().backward()
    _assert_grads(grads(student), ref_grads, rtol=rtol, atol=atol)
    assert not [n for n, p in teacher.named_parameters() if p.grad is not None], "the teacher got gradients"
    return ours.detach()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe"])
def test_distillation_matches_trl_generalized_jsd_on_the_full_logits(model_type, beta):
    student, teacher = tiny_loss_model(model_type), tiny_loss_model(model_type, seed=1)
    batch = padded_batch()
    _distillation_case(student, teacher, batch, _shift(batch["labels"]) != -100, beta=beta, temperature=0.8)


def test_teacher_of_another_family_and_hidden_size_with_biased_heads():
    student, teacher = tiny_loss_model("llama"), tiny_loss_model("qwen2", seed=1, **SMALL)
    _biased_head(student, seed=1)
    _biased_head(teacher, seed=2)
    batch = padded_batch(seed=2)
    _distillation_case(student, teacher, batch, _shift(batch["labels"]) != -100, beta=0.3, temperature=1.5)


@pytest.mark.parametrize("student_type, teacher_type, caps", [
    ("gemma2", "gemma2", {}),  # the families' own soft-cap, 5.0
    ("gemma3_text", "gemma3_text", {}),
    ("gemma2", "gemma3_text", (0.3, 0.7)),  # caps small enough to bite on tiny logits, and different
    ("gemma2", "llama", (0.4, None)),  # a capped student, an uncapped teacher
    ("llama", "gemma3_text", (None, 0.4)),
    ("gemma2", "gemma2", (None, None)),
])
# beta 0.5 by default; the pure forward and reverse KL ends of the grid run nightly (slow)
@pytest.mark.parametrize("beta", [pytest.param(0.0, marks=pytest.mark.slow), 0.5,
                                  pytest.param(1.0, marks=pytest.mark.slow)])
def test_soft_capped_models_distil_each_with_its_own_softcap(student_type, teacher_type, caps, beta):
    """The reference is the models' own logits, which Transformers soft-caps in forward."""
    over = [{} if not caps else {"final_logit_softcapping": cap} for cap in (caps or (None, None))]
    student = tiny_loss_model(student_type, **over[0])  # Gemma: tied embeddings
    teacher = tiny_loss_model(teacher_type, seed=1, **over[1])
    batch = padded_batch()
    _distillation_case(student, teacher, batch, _shift(batch["labels"]) != -100, beta=beta, temperature=0.7)


def test_without_labels_the_shifted_attention_mask_counts_tokens():
    student, teacher = tiny_loss_model("llama"), tiny_loss_model("llama", seed=1, **SMALL)
    batch = _inputs(padded_batch())
    counted = F.pad(batch["attention_mask"][:, 1:] != 0, (0, 1), value=False)
    _distillation_case(student, teacher, batch, counted, beta=0.5)
    no_mask = {"input_ids": batch["input_ids"]}
    counted = F.pad(torch.ones_like(counted[:, 1:]), (0, 1), value=False)
    per_token = _distillation_case(student, teacher, no_mask, counted, reduction="none")
    assert (per_token[:, -1] == 0).all() and (per_token[:, :-1] > 0).all()


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_num_items_in_batch_and_packed_shift_labels(reduction):
    student, teacher = tiny_loss_model("qwen3"), tiny_loss_model("qwen3", seed=1)
    batch = dict(packed_batch(), num_items_in_batch=40) if reduction == "sum" else packed_batch()
    _distillation_case(student, teacher, batch, batch["shift_labels"] != -100, reduction=reduction, beta=0.2)


def test_teacher_batch_is_what_the_teacher_sees():
    student, teacher = tiny_loss_model("llama"), tiny_loss_model("llama", seed=1)
    batch, other = padded_batch(seed=0), padded_batch(seed=7)
    s_logits = student(**_inputs(batch)).logits
    t_logits = teacher(**_inputs(other)).logits
    ref = reference_generalized_jsd(s_logits, t_logits, _shift(batch["labels"]) != -100)
    ours = model_patches.causal_lm_distillation_loss(student, teacher, **batch, teacher_batch=other)
    _assert_close(ours, ref.detach(), what="loss")


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: model_patches.causal_lm_token_logprobs(tiny_loss_model("cohere", logit_scale=0.5), **padded_batch()),
         r"causal_lm_token_logprobs cannot run .*config.logit_scale=0.5"),
        (lambda: model_patches.causal_lm_distillation_loss(
            tiny_loss_model("llama"), tiny_loss_model("granite", logits_scaling=4.0), **padded_batch()),
         r"causal_lm_distillation_loss cannot run Granite.*config.logits_scaling=4.0"),
        (lambda: model_patches.causal_lm_distillation_loss(
            tiny_loss_model("llama"), tiny_loss_model("llama", vocab_size=301), **padded_batch()),
         r"student's vocabulary has 300 entries and the teacher's 301"),
        (lambda: model_patches.causal_lm_distillation_loss(
            tiny_loss_model("llama"), tiny_loss_model("llama"), **padded_batch(), teacher_batch=padded_batch(t=9)),
         r"student's rows are \(2, 12\) and the teacher's \(2, 9\)"),
        (lambda: model_patches.causal_lm_token_logprobs(tiny_loss_model("llama"), **_inputs(padded_batch())),
         r"needs labels=\[B, T\] or shift_labels"),
    ],
    ids=["logit-scale", "logits-scaling", "vocab", "teacher-rows", "no-labels"],
)
def test_what_cannot_be_reproduced_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_wrapped_head_is_refused():
    model = tiny_loss_model("llama")
    model.lm_head = nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        model_patches.causal_lm_token_logprobs(model, **padded_batch())


# ---------------------------------------------------------------- docs snippets


DOCS_PAGE = "docs/trainers.md"


def _docs_snippet() -> str:
    text = (pathlib.Path(__file__).resolve().parents[3] / DOCS_PAGE).read_text()
    found = re.search(r"### A GRPO and a GKD loss on a model\n+```python\n(.*?)```", text, re.S)
    assert found, f"{DOCS_PAGE} has no python block under '### A GRPO and a GKD loss on a model'"
    return found.group(1)


def test_docs_grpo_and_gkd_snippets_run_and_match_the_references():
    namespace: dict = {}
    exec(compile(_docs_snippet(), DOCS_PAGE, "exec"), namespace)
    model, teacher = tiny_loss_model("llama"), tiny_loss_model("qwen2", seed=1, **SMALL)
    batch = padded_batch()
    advantages = torch.tensor([1.0, -0.5])
    with torch.no_grad():
        old_logp = model_patches.causal_lm_token_logprobs(model, **batch)
    assert not old_logp.requires_grad
    old_logp = old_logp + 0.1 * _weights(old_logp.shape, 9)  # ratios away from 1: the clip bites

    targets = _shift(batch["labels"])
    ref_lp, ref_ent = reference_token_logprobs(model(**_inputs(batch)).logits, targets)
    mask = (targets != -100).double()
    ratio = torch.exp(ref_lp - old_logp.double())
    adv = advantages.double()[:, None]
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ref = -((surrogate + 0.01 * ref_ent) * mask).sum() / mask.sum()
    ref.backward()
    ref_grads = grads(model)
    loss = namespace["grpo_loss"](model, batch, old_logp, advantages)
    _assert_close(loss, ref.detach(), what="grpo")
    loss.backward()
    _assert_grads(grads(model), ref_grads)

    kd = namespace["gkd_loss"](model, teacher, batch)
    with torch.no_grad():
        ref_kd = reference_generalized_jsd(model(**_inputs(batch)).logits, teacher(**_inputs(batch)).logits,
                                           targets != -100, beta=0.5, temperature=0.9)
    _assert_close(kd, ref_kd, what="gkd")


# ---------------------------------------------------------------- FSDP2


def fsdp_step(mesh):
    """Run on each of 2 gloo processes: both functions on ``fully_shard`` student and teacher
    (each decoder layer, then the root), this rank's batch; references from unsharded copies."""
    from torch.distributed import get_rank, get_world_size
    from torch.distributed.tensor import DTensor

    from bench.harness.comm_bytes import CommBytes
    from tests.model_patches.loss.workers.fsdp import _full_grads, _shard

    if mesh is None:
        return None
    student, teacher = tiny_loss_model("llama"), tiny_loss_model("qwen2", seed=1, **SMALL)
    ref_student, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    _shard(student, mesh, False)
    from torch.distributed.fsdp import fully_shard

    for layer in teacher.model.layers:
        fully_shard(layer, mesh=mesh)
    # FSDP2 keeps a root's parameters gathered after a forward without backward unless told not to.
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)

    backward_bytes: list = []

    def run(s, t, batch):
        w = _weights(batch["labels"].shape, 3)
        with torch.no_grad():
            old = model_patches.causal_lm_token_logprobs(s, **batch)
        logp, ent = model_patches.causal_lm_token_logprobs(s, **batch, return_entropy=True, temperature=0.9)
        with CommBytes() as lp_backward:
            ((logp * w).sum() + 0.1 * ent.sum()).backward()
        lp_grads = _full_grads(s)
        s.zero_grad()
        kd = model_patches.causal_lm_distillation_loss(s, t, **batch, beta=0.4)
        with CommBytes() as kd_backward:
            kd.backward()
        kd_grads = _full_grads(s)
        s.zero_grad()
        backward_bytes.append((dict(lp_backward.by_op), dict(kd_backward.by_op)))
        return [old, logp.detach(), ent.detach(), kd.detach()], lp_grads, kd_grads

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(student, teacher, padded_batch(seed=100 + get_rank()))
    refs = [run(ref_student, ref_teacher, padded_batch(seed=100 + r)) for r in range(get_world_size())]
    return {
        "ours": ours, "refs": refs, "backward_bytes": backward_bytes[0], "warnings": [str(w.message) for w in caught],
        "teacher_grads": [n for n, p in teacher.named_parameters() if p.grad is not None],
        "resharded": all(isinstance(p, DTensor) for m in (student, teacher) for p in m.parameters()),
    }


def test_fsdp2_student_and_teacher():
    from bench.harness.dist_pool import DistPool

    pool = DistPool(2)
    try:
        results = pool.run(fsdp_step, (2,))
    finally:
        pool.close()
    for rank, r in enumerate(results):
        (values, lp_grads, kd_grads), refs = r["ours"], r["refs"]
        for got, want, what in zip(values, refs[rank][0], ("old logp", "logp", "entropy", "distillation")):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
        for got, index in ((lp_grads, 1), (kd_grads, 2)):  # FSDP2's gradient: the mean over processes
            _assert_grads(got, {n: sum(ref[index][n] for ref in refs) / len(refs) for n in refs[0][index]})
        assert not r["teacher_grads"], r["teacher_grads"]
        # The teacher adds no backward work: the same collectives as the student-only log-prob loss.
        lp_backward, kd_backward = r["backward_bytes"]
        assert lp_backward and kd_backward == lp_backward, (lp_backward, kd_backward)
        assert r["resharded"], "a parameter was left unsharded after the steps"
        assert not [w for w in r["warnings"] if "FSDP" in w], r["warnings"]


#: Every family causal_lm_loss verifies, and decoder + lm_head families it does not list (they run
#: with a warning): values must equal the full logits' in each.
SWEEP = sorted(VERIFIED_MODEL_TYPES) + ["gpt_oss", "olmo3", "phi", "starcoder2", "exaone4", "apertus"]


@pytest.mark.parametrize("model_type", SWEEP)
def test_every_family_gives_the_full_logits_log_probs_entropy_and_divergence(model_type):
    model = tiny_loss_model(model_type).eval()  # eval: some families default to dropout
    batch = padded_batch(seed=5)
    targets = _shift(batch["labels"])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        logits = model(**_inputs(batch)).logits
        logp, ent = model_patches.causal_lm_token_logprobs(model, **batch, temperature=0.9, return_entropy=True)
        ref_lp, ref_ent = reference_token_logprobs(logits, targets, temperature=0.9,
                                                   softcap=None)  # the model's own logits are capped already
        _assert_close(logp, ref_lp, what=f"{model_type} logp")
        _assert_close(ent, ref_ent, what=f"{model_type} entropy")
        teacher = tiny_loss_model(model_type, seed=1).eval()
        kd = model_patches.causal_lm_distillation_loss(model, teacher, **batch, beta=0.3)
        ref = reference_generalized_jsd(logits[:, :-1], teacher(**_inputs(batch)).logits[:, :-1],
                                        targets[:, :-1] != -100, beta=0.3)
        _assert_close(kd, ref, what=f"{model_type} distillation")
