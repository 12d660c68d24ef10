"""Every public loss form takes every batch shape torch's counterpart takes, the unbatched ``()``
included, for every reduction and output, and any subset of its outputs may carry a gradient.

A property over batch shapes ``()``, ``(N,)``, ``(B, T)`` and ``(B, T, K)`` (sizes 0 included),
forms (functions, module forms, the pipeline ``loss_fn``), reductions and outputs (log-probs,
entropy, extra statistics): values and gradients against the fp64 references of the documented
semantics, and the unbatched calls against torch's own functions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import functional_ce
from tests.support.reference import (
    reference_cross_entropy,
    reference_generalized_jsd,
    reference_token_logprobs,
    reference_token_stats,
)

V, H = 11, 6
TOL = 2e-5

BATCH_SHAPES = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 5)),
    st.tuples(st.integers(1, 3), st.integers(0, 4)),
    st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)),
)


@dataclasses.dataclass
class Inputs:
    """Seeded fp32 inputs of one call: the student's (logits, or hidden with weight and bias),
    the teacher's, labels ``[*shape]`` (a quarter ignored), and a mask ``[*shape]``."""

    logits: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    teacher_logits: torch.Tensor
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor


def _inputs(shape: tuple[int, ...], seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, shape, generator=g)
    labels = torch.where(torch.rand(shape, generator=g) < 0.25, -100, labels)
    return Inputs(
        logits=torch.randn(*shape, V, generator=g) * 3, hidden=torch.randn(*shape, H, generator=g),
        weight=torch.randn(V, H, generator=g), bias=torch.randn(V, generator=g),
        teacher_logits=torch.randn(*shape, V, generator=g) * 3, teacher_hidden=torch.randn(*shape, H, generator=g),
        teacher_weight=torch.randn(V, H, generator=g), labels=labels, mask=torch.rand(shape, generator=g) < 0.8,
    )


@dataclasses.dataclass(frozen=True)
class Form:
    """A public form: ``run(tensors, inputs, opts)`` calls it, ``truth(tensors64, inputs, opts)``
    is the fp64 reference of the same outputs; ``leaves`` names the inputs that get gradients."""

    kind: str  # "cross_entropy" | "token_logprobs" | "distillation"
    leaves: tuple[str, ...]
    run: Callable[[dict, Inputs, dict], Any]
    truth: Callable[[dict, Inputs, dict], Any]


def _head(t: dict, prefix: str = "") -> torch.Tensor:
    bias = t.get(f"{prefix}bias")
    return F.linear(t[f"{prefix}hidden"], t[f"{prefix}weight"], bias)


def _ce_truth(logits: Callable[[dict], torch.Tensor]) -> Callable:
    return lambda t, x, o: reference_cross_entropy(logits(t), x.labels, mask=o.get("mask"),
                                                   reduction=o.get("reduction", "mean"))


def _logprob_truth(logits: Callable[[dict], torch.Tensor]) -> Callable:
    def truth(t: dict, x: Inputs, o: dict) -> tuple:
        labels = torch.where(x.mask, x.labels, -100) if "mask" in o else x.labels
        scaling = {k: o[k] for k in ("temperature",) if k in o}
        logp, entropy = reference_token_logprobs(logits(t), labels, **scaling)
        outs = (logp, entropy) if o.get("return_entropy") else (logp,)
        return (*outs, *reference_token_stats(logits(t), labels, tuple(o.get("stats", ())), **scaling))
    return truth


def _kd_truth(student: Callable[[dict], torch.Tensor], teacher: Callable[[dict], torch.Tensor]) -> Callable:
    def truth(t: dict, x: Inputs, o: dict) -> torch.Tensor:
        counted = (x.labels != -100) & (x.mask if "mask" in o else True)
        return reference_generalized_jsd(student(t), teacher(t), counted, beta=o.get("beta", 0.5),
                                         reduction=o.get("reduction", "mean"))
    return truth


def _linear_ce(t: dict, x: Inputs, o: dict) -> torch.Tensor:
    return functional_ce.linear_cross_entropy(t["hidden"], t["weight"], x.labels, bias=t["bias"], **o)


def _held_and_batch(o: dict) -> tuple[dict, dict]:
    """A module form's options (held by the module) and its per-batch keywords (the mask)."""
    return {k: v for k, v in o.items() if k != "mask"}, {k: o[k] for k in ("mask",) if k in o}


def _module_linear_ce(t: dict, x: Inputs, o: dict) -> torch.Tensor:
    held, batch = _held_and_batch(o)
    return functional_ce.LinearCrossEntropyLoss(**held)(t["hidden"], t["weight"], x.labels, t["bias"], **batch)


def _pipeline_ce(t: dict, x: Inputs, o: dict) -> torch.Tensor:
    head = torch.nn.Linear(H, V)
    del head.weight, head.bias
    head.weight, head.bias = t["weight"], t["bias"]  # the test's leaves, not parameter copies
    return functional_ce.pipeline_loss_fn(head, **o)(t["hidden"], x.labels)


def _module_ce(t: dict, x: Inputs, o: dict) -> torch.Tensor:
    held, batch = _held_and_batch(o)
    return functional_ce.CrossEntropyLoss(**held)(t["logits"], x.labels, **batch)


FORMS = {
    "cross_entropy": Form("cross_entropy", ("logits",),
                          lambda t, x, o: functional_ce.cross_entropy(t["logits"], x.labels, **o),
                          _ce_truth(lambda t: t["logits"])),
    "CrossEntropyLoss": Form("cross_entropy", ("logits",), _module_ce, _ce_truth(lambda t: t["logits"])),
    "linear_cross_entropy": Form("cross_entropy", ("hidden", "weight", "bias"), _linear_ce, _ce_truth(_head)),
    "LinearCrossEntropyLoss": Form("cross_entropy", ("hidden", "weight", "bias"), _module_linear_ce,
                                   _ce_truth(_head)),
    "pipeline_loss_fn": Form("cross_entropy", ("hidden", "weight", "bias"), _pipeline_ce, _ce_truth(_head)),
    "token_logprobs": Form("token_logprobs", ("logits",),
                           lambda t, x, o: functional_ce.token_logprobs(t["logits"], x.labels, **o),
                           _logprob_truth(lambda t: t["logits"])),
    "linear_token_logprobs": Form(
        "token_logprobs", ("hidden", "weight", "bias"),
        lambda t, x, o: functional_ce.linear_token_logprobs(t["hidden"], t["weight"], x.labels, bias=t["bias"], **o),
        _logprob_truth(_head)),
    "distillation_loss": Form(
        "distillation", ("logits", "teacher_logits"),
        lambda t, x, o: functional_ce.distillation_loss(t["logits"], t["teacher_logits"], labels=x.labels, **o),
        _kd_truth(lambda t: t["logits"], lambda t: t["teacher_logits"])),
    "linear_distillation_loss": Form(
        "distillation", ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight"),
        lambda t, x, o: functional_ce.linear_distillation_loss(
            t["hidden"], t["weight"], t["teacher_hidden"], t["teacher_weight"], student_bias=t["bias"],
            labels=x.labels, **o),
        _kd_truth(_head, lambda t: _head(t, "teacher_"))),
}


def _options(kind: str, data: st.DataObject) -> dict[str, Any]:
    opts: dict[str, Any] = {"chunk_size": data.draw(st.sampled_from([None, "auto", 1, 3]), label="chunk_size"),
                            "compile_chunks": False}
    if data.draw(st.booleans(), label="mask"):
        opts["mask"] = True
    if kind == "token_logprobs":
        opts["return_entropy"] = data.draw(st.booleans(), label="return_entropy")
        opts["temperature"] = data.draw(st.sampled_from([1.0, 0.7]), label="temperature")
        opts["stats"] = data.draw(st.sampled_from([(), ("mean_logits",), ("is_top1", "log_sum_sq_probs")]),
                                  label="stats")
    else:
        opts["reduction"] = data.draw(st.sampled_from(["mean", "sum", "none"]), label="reduction")
    if kind == "distillation":
        opts["beta"] = data.draw(st.sampled_from([0.0, 0.5, 1.0]), label="beta")
    return opts


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if want.dtype == torch.bool:
        assert got.dtype == torch.bool and torch.equal(got, want), what
        return
    assert got.dtype == torch.float32, f"{what}: dtype {got.dtype}"
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    tol = TOL * (1 + (want.abs().max().item() if want.numel() else 0.0))
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _weighted(outputs: tuple[torch.Tensor, ...], grad_to: tuple[bool, ...], seed: int) -> Optional[torch.Tensor]:
    """``sum(upstream_i * output_i)`` over the outputs chosen to carry a gradient (None: none)."""
    g = torch.Generator().manual_seed(seed)
    terms = [(o * (torch.rand(o.shape, generator=g, dtype=torch.float64) - 0.3).to(o.dtype)).sum()
             for o, chosen in zip(outputs, grad_to) if chosen]
    return sum(terms) if terms else None


@given(form=st.sampled_from(sorted(FORMS)), shape=BATCH_SHAPES, seed=st.integers(0, 2**16), data=st.data())
def test_every_form_takes_every_batch_shape_and_any_upstream_gradient(form, shape, seed, data):
    spec = FORMS[form]
    opts = _options(spec.kind, data)
    x = _inputs(shape, seed)
    if opts.get("mask") is True:
        opts["mask"] = x.mask
    tensors = {name: getattr(x, name).clone().requires_grad_(name in spec.leaves)
               for name in ("logits", "hidden", "weight", "bias", "teacher_logits", "teacher_hidden",
                            "teacher_weight")}
    tensors64 = {name: t.detach().double().requires_grad_(name in spec.leaves) for name, t in tensors.items()}

    got = _as_tuple(spec.run(tensors, x, opts))
    want = _as_tuple(spec.truth(tensors64, x, opts))
    per_token = spec.kind == "token_logprobs" or opts.get("reduction") == "none"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == (shape if per_token else ()), (form, i, tuple(a.shape), shape)
        _check_close(a, b, f"{form} output {i}")

    # the differentiable outputs: log-probs and entropy (the extra statistics have no gradient)
    differentiable = len(got) - len(opts.get("stats", ()))
    grad_to = tuple(data.draw(st.booleans(), label=f"gradient to output {i}") if i < differentiable else False
                    for i in range(len(got)))
    loss, loss64 = _weighted(got, grad_to, seed + 1), _weighted(want, grad_to, seed + 1)
    if loss is None:  # no output carries a gradient: nothing flows, nothing is written
        assert all(tensors[name].grad is None for name in spec.leaves)
        return
    loss.backward()
    truths = torch.autograd.grad(loss64, [tensors64[name] for name in spec.leaves], allow_unused=True)
    for name, truth in zip(spec.leaves, truths):
        grad = tensors[name].grad
        assert grad is not None and grad.shape == tensors[name].shape, (form, name)
        _check_close(grad, torch.zeros_like(grad, dtype=torch.float64) if truth is None else truth,
                     f"{form} gradient of {name}")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_unbatched_calls_match_torch(reduction):
    """One sample, as torch takes it: ``[V]`` logits (or ``[H]`` hidden) and a 0-d label."""
    g = torch.Generator().manual_seed(0)
    logits, hidden, weight = torch.randn(V, generator=g), torch.randn(H, generator=g), torch.randn(V, H, generator=g)
    label = torch.tensor(2)
    ours = functional_ce.cross_entropy(logits, label, reduction=reduction)
    assert ours.shape == () and torch.allclose(ours, F.cross_entropy(logits, label, reduction=reduction))
    ours = functional_ce.linear_cross_entropy(hidden, weight, label, reduction=reduction)
    theirs = F.linear_cross_entropy(hidden, weight, label, reduction=reduction)
    assert ours.shape == () and torch.allclose(ours, theirs, atol=1e-6)
    module = functional_ce.CrossEntropyLoss(reduction=reduction)(logits, label)
    assert torch.allclose(module, torch.nn.CrossEntropyLoss(reduction=reduction)(logits, label))
    logp = functional_ce.token_logprobs(logits, label)
    assert logp.shape == () and torch.allclose(logp, torch.log_softmax(logits, -1)[2])
    logp = functional_ce.linear_token_logprobs(hidden, weight, label)
    assert logp.shape == () and torch.allclose(logp, torch.log_softmax(weight @ hidden, -1)[2], atol=1e-6)
    assert math.isfinite(functional_ce.distillation_loss(logits, logits.flip(0), reduction=reduction).item())
