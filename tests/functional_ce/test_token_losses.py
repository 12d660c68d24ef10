"""Token log-probs with entropy, and distillation: fp64 parity of values and gradients over options,
dtypes, forms and chunk sizes; edge cases; bad input; the compile ladder."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import functional_ce
from tests.functional_ce.ce_cases import ROUNDING
from tests.support.reference import reference_generalized_jsd, reference_token_logprobs, reference_token_stats

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
CHUNKS = st.sampled_from([None, "auto", 1, 5, 16])
#: Distillation's per-model logit options: none; the student's soft-cap only; the teacher's only;
#: both soft-caps (different) with both scales (different).
CAPS = [{}, {"softcap": 3.0}, {"teacher_softcap": 2.0},
        {"softcap": 3.0, "teacher_softcap": 5.0, "logit_scale": 1.5, "teacher_logit_scale": 0.5}]


def _tol(dtype: torch.dtype, scale: float = 1.0) -> float:
    return 20 * ROUNDING[dtype] * scale + 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), v=st.integers(2, 70), dtype=DTYPES, chunk=CHUNKS, seed=st.integers(0, 2**16),
       temperature=st.sampled_from([1.0, 0.6, 1.7]), softcap=st.sampled_from([None, 4.0]),
       form=st.sampled_from(["logits", "hidden"]), ignored=st.floats(0.0, 0.5))
def test_token_logprobs_and_entropy_match_fp64_for_any_upstream_gradient(n, v, dtype, chunk, seed, temperature,
                                                                         softcap, form, ignored):
    g = torch.Generator().manual_seed(seed)
    h = 8
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = -100
    up_logp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 2).to(dtype).requires_grad_()
    kw = dict(temperature=temperature, softcap=softcap, return_entropy=True, chunk_size=chunk, compile_chunks=False)
    if form == "logits":
        logits = (hidden.detach().float() @ weight.detach().float().T).to(dtype).requires_grad_()
        leaves, ref_logits = (logits,), logits
        logp, ent = functional_ce.token_logprobs(logits, labels, **kw)
    else:
        leaves, ref_logits = (hidden, weight), hidden.double() @ weight.double().T
        logp, ent = functional_ce.linear_token_logprobs(hidden, weight, labels, **kw)
    ref_lp, ref_ent = reference_token_logprobs(ref_logits, labels, temperature=temperature, softcap=softcap)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (n,)
    scale = 1.0 if form == "logits" else 4.0  # the hidden form rounds its logits once more
    _close(logp, ref_lp, _tol(dtype, scale), "logp")
    _close(ent, ref_ent, _tol(dtype, scale), "entropy")
    got = torch.autograd.grad((logp * up_logp + ent * up_ent).sum(), leaves)
    want = torch.autograd.grad((ref_lp * up_logp + ref_ent * up_ent).sum(), leaves)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        _close(a, b, _tol(dtype, 4 * scale) * max(1.0, b.abs().max().item()), "gradient")


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), v=st.integers(2, 60), dtype=DTYPES, chunk=CHUNKS, seed=st.integers(0, 2**16),
       beta=st.sampled_from([0.0, 1.0, 0.5, 0.1]), temperature=st.sampled_from([1.0, 2.0]),
       reduction=st.sampled_from(["mean", "sum", "none"]), with_labels=st.booleans(), with_mask=st.booleans(),
       teacher_grad=st.booleans(), caps=st.sampled_from(CAPS))
def test_distillation_from_logits_matches_trl_gkd_formula_in_fp64(n, v, dtype, chunk, seed, beta, temperature,
                                                                  reduction, with_labels, with_mask, teacher_grad,
                                                                  caps):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(n, v, generator=g) * 2).to(dtype).requires_grad_()
    teacher = (torch.randn(n, v, generator=g) * 2).to(dtype).requires_grad_(teacher_grad)
    labels = torch.randint(0, v, (n,), generator=g) if with_labels else None
    if labels is not None:
        labels[torch.rand(n, generator=g) < 0.3] = -100
    mask = (torch.rand(n, generator=g) < 0.7) if with_mask else None
    counted = torch.ones(n, dtype=torch.bool)
    counted &= labels != -100 if labels is not None else True
    counted &= mask if mask is not None else True
    got = functional_ce.distillation_loss(student, teacher, labels=labels, mask=mask, beta=beta,
                                          temperature=temperature, reduction=reduction, chunk_size=chunk,
                                          compile_chunks=False, **caps)
    want = reference_generalized_jsd(student, teacher, counted, beta=beta, temperature=temperature,
                                     reduction=reduction, **caps)
    assert got.dtype == torch.float32 and got.shape == want.shape
    tol = _tol(dtype, 10.0 if reduction == "sum" else 1.0) * max(1.0, want.abs().max().item())
    _close(got, want, tol, "loss")
    up = torch.randn(got.shape, generator=g, dtype=torch.float64)
    leaves = (student, teacher) if teacher_grad else (student,)
    g_got = torch.autograd.grad((got.double() * up).sum(), leaves)
    g_want = torch.autograd.grad((want * up).sum(), leaves)
    for a, b in zip(g_got, g_want):
        _close(a, b, _tol(dtype, 4.0) * max(1.0, b.abs().max().item()), "gradient")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("caps", [CAPS[0], CAPS[-1]], ids=["plain", "capped"])
def test_linear_distillation_matches_fp64_with_a_teacher_of_another_width(beta, recompute, reduction, caps):
    g = torch.Generator().manual_seed(int(beta * 10) + recompute)
    n, v, hs, ht = 29, 53, 12, 20
    s_h = torch.randn(n, hs, generator=g).requires_grad_()
    s_w = (torch.randn(v, hs, generator=g) / 2).requires_grad_()
    s_b = torch.randn(v, generator=g).requires_grad_()
    t_h, t_w = torch.randn(n, ht, generator=g).requires_grad_(), (torch.randn(v, ht, generator=g) / 2)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    got = functional_ce.linear_distillation_loss(
        s_h, s_w, t_h, t_w, student_bias=s_b, labels=labels, beta=beta, temperature=1.5, reduction=reduction,
        recompute_logits_in_backward=recompute, chunk_size=8, compile_chunks=False, **caps)
    want = reference_generalized_jsd(
        s_h.double() @ s_w.double().T + s_b.double(), t_h.double() @ t_w.double().T, labels != -100, beta=beta,
        temperature=1.5, reduction=reduction, **caps)
    _close(got, want, 1e-5, "loss")
    up = torch.rand(got.shape, generator=g, dtype=torch.float64)
    leaves = (s_h, s_w, s_b, t_h)
    for a, b, name in zip(torch.autograd.grad((got.double() * up).sum(), leaves),
                          torch.autograd.grad((want * up).sum(), leaves), ("hidden", "weight", "bias", "teacher")):
        _close(a, b, 1e-5 * max(1.0, b.abs().max().item()), name)


def test_no_counted_token_gives_zero_and_zero_gradients_never_nan():
    student, teacher = torch.randn(5, 9, requires_grad=True), torch.randn(5, 9)
    labels = torch.full((5,), -100)
    loss = functional_ce.distillation_loss(student, teacher, labels=labels)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(student.grad, torch.zeros_like(student))
    loss = functional_ce.distillation_loss(student, teacher, mask=torch.zeros(5), num_label_tokens=0)
    assert loss.item() == 0.0
    logits = torch.randn(5, 9, requires_grad=True)
    logp, ent = functional_ce.token_logprobs(logits, labels, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(logp, torch.zeros(5)) and torch.equal(ent, torch.zeros(5))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_masked_out_classes_give_finite_entropy_and_divergence():
    logits = torch.randn(4, 6)
    logits[:, :2] = -math.inf  # classes a sampler masked out: probability 0, no NaN
    logits.requires_grad_()
    labels = torch.tensor([2, 3, 4, 5])
    logp, ent = functional_ce.token_logprobs(logits, labels, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    ref_lp, _ = reference_token_logprobs(logits.detach()[:, 2:], labels - 2)
    p = torch.softmax(logits.detach()[:, 2:].double(), -1)
    _close(logp, ref_lp, 1e-6, "logp")
    _close(ent, -(p * p.log()).sum(-1), 1e-6, "entropy")
    assert torch.isfinite(logits.grad).all()
    kd = functional_ce.distillation_loss(logits, logits.detach().clone(), beta=0.0)
    assert torch.isfinite(kd) and abs(kd.item()) < 1e-6


STATS = st.lists(st.sampled_from(functional_ce.spec.TOKEN_STATS), unique=True, max_size=3).map(tuple)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), v=st.integers(2, 70), dtype=DTYPES, chunk=CHUNKS, seed=st.integers(0, 2**16),
       temperature=st.sampled_from([1.0, 0.6, 1.7]), softcap=st.sampled_from([None, 4.0]),
       logit_scale=st.sampled_from([1.0, 0.5, 1.5]), stats=STATS, entropy=st.booleans(),
       form=st.sampled_from(["logits", "hidden"]), ignored=st.floats(0.0, 0.5))
def test_extra_statistics_and_logit_scale_match_fp64(n, v, dtype, chunk, seed, temperature, softcap, logit_scale,
                                                     stats, entropy, form, ignored):
    """is_top1, log(sum p**2) and the mean tempered logit (TRL's fused-head fields), in the order
    asked, after the log-probs (and entropy): the fp64 definitions, no gradient; the log-probs'
    and entropy's values and gradients are unchanged by asking for them."""
    g = torch.Generator().manual_seed(seed)
    h = 8
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 2).to(dtype).requires_grad_()
    ref_logits = hidden.double() @ weight.double().T
    labels = torch.randint(0, v, (n,), generator=g)
    top = torch.rand(n, generator=g) < 0.5  # half the labels are the arg-max: is_top1 is True there
    labels = torch.where(top, ref_logits.argmax(-1), labels)
    labels[torch.rand(n, generator=g) < ignored] = -100
    kw = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale, return_entropy=entropy,
              stats=stats, chunk_size=chunk, compile_chunks=False)
    if form == "logits":
        logits = ref_logits.detach().to(dtype).requires_grad_()
        leaves, ref_logits = (logits,), logits
        out = functional_ce.token_logprobs(logits, labels, **kw)
    else:
        leaves = (hidden, weight)
        out = functional_ce.linear_token_logprobs(hidden, weight, labels, **kw)
    scaling = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    ref = list(reference_token_logprobs(ref_logits, labels, **scaling))[: 1 + entropy]
    ref += reference_token_stats(ref_logits, labels, stats, **scaling)
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(ref) == 1 + entropy + len(stats)
    scale = 1.0 if form == "logits" else 4.0
    z = torch.sort(ref_logits.detach().double(), -1, descending=True).values
    clear = (z[:, 0] - z[:, 1] > 1e-2) if v > 1 else torch.ones(n, dtype=torch.bool)  # no near-tie to round away
    for name, got, want in zip(("logp", "entropy")[: 1 + entropy] + stats, out, ref):
        assert got.shape == (n,)
        if name == "is_top1":
            assert got.dtype == torch.bool and not got.requires_grad
            assert torch.equal(got[clear], want[clear]), name
            continue
        assert got.dtype == torch.float32
        _close(got, want, _tol(dtype, scale) * (1 + abs(logit_scale) * 4), name)
        assert got.requires_grad == (name in ("logp", "entropy")), name
    up = [torch.randn(n, generator=g) for _ in range(1 + entropy)]
    got = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out, up)), leaves)
    want = torch.autograd.grad(sum((o * u).sum() for o, u in zip(ref, up)), leaves)
    for a, b in zip(got, want):
        _close(a, b, _tol(dtype, 4 * scale) * max(1.0, b.abs().max().item()), "gradient")


def test_is_top1_is_the_first_arg_max_like_torch_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 5.0]])
    labels = torch.tensor([1, 2, 0])
    logp, top1 = functional_ce.token_logprobs(logits, labels, stats=("is_top1",))
    assert top1.tolist() == [True, False, True]
    assert torch.equal(top1, logits.argmax(-1) == labels)


def test_without_the_new_keywords_the_return_types_are_unchanged():
    logits, labels = torch.randn(3, 9), torch.randint(0, 9, (3,))
    assert isinstance(functional_ce.token_logprobs(logits, labels, stats=()), torch.Tensor)
    assert len(functional_ce.token_logprobs(logits, labels, return_entropy=True, stats=[])) == 2
    assert len(functional_ce.token_logprobs(logits, labels, stats=["mean_logits"])) == 2


@pytest.mark.parametrize("fn", [functional_ce.distillation_loss, functional_ce.linear_distillation_loss])
def test_distillation_signatures_list_each_models_softcap_and_scale(fn):
    """The teacher's soft-cap and scale are their own keywords, defaulting to none (not the student's)."""
    params = inspect.signature(fn).parameters
    for name, default in {"softcap": None, "logit_scale": 1.0, "teacher_softcap": None,
                          "teacher_logit_scale": 1.0}.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default, name


def test_entropy_default_is_off_and_shapes_follow_the_labels():
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    logp = functional_ce.token_logprobs(logits, labels)
    assert isinstance(logp, torch.Tensor) and logp.shape == (2, 3) and logp.dtype == torch.float32
    _close(logp, reference_token_logprobs(logits, labels)[0], 1e-6, "logp")


def test_double_backward_raises():
    logits = torch.randn(3, 7, requires_grad=True)
    logp = functional_ce.token_logprobs(logits, torch.tensor([1, 2, 3]))
    (grad,) = torch.autograd.grad(logp.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


@pytest.mark.parametrize("call, match, error", [
    (lambda x, y: functional_ce.token_logprobs(x, y, temperature=0.0), "temperature", ValueError),
    (lambda x, y: functional_ce.token_logprobs(x, y, temperature=math.inf), "temperature", ValueError),
    (lambda x, y: functional_ce.token_logprobs(x, y, temperature="1"), "temperature", TypeError),
    (lambda x, y: functional_ce.token_logprobs(x, y.float()), "labels", TypeError),
    (lambda x, y: functional_ce.token_logprobs(x, y + 7), "labels", ValueError),
    (lambda x, y: functional_ce.token_logprobs(x, y, label_smoothing=0.1), "label_smoothing", TypeError),
    (lambda x, y: functional_ce.token_logprobs(x, y, stats=("top1",)), "stats", ValueError),
    (lambda x, y: functional_ce.token_logprobs(x, y, stats="is_top1"), "stats", TypeError),
    (lambda x, y: functional_ce.token_logprobs(x, y, stats=("is_top1", "is_top1")), "twice", ValueError),
    (lambda x, y: functional_ce.token_logprobs(x, y, logit_scale=math.nan), "logit_scale", ValueError),
    (lambda x, y: functional_ce.cross_entropy(x, y, stats=("is_top1",)), "stats", TypeError),
    (lambda x, y: functional_ce.distillation_loss(x, x, beta=1.5), "beta", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x, beta=-0.1), "beta", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x[:, :5]), "one shape", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x, labels=y, reduction="batchmean"), "reduction", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x, softcap=0.0), "softcap", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x, teacher_softcap=math.inf), "teacher_softcap", ValueError),
    (lambda x, y: functional_ce.distillation_loss(x, x, teacher_softcap="2"), "teacher_softcap", TypeError),
    (lambda x, y: functional_ce.distillation_loss(x, x, teacher_logit_scale=math.nan), "teacher_logit_scale",
     ValueError),
    (lambda x, y: functional_ce.cross_entropy(x, y, teacher_softcap=2.0), "teacher_softcap", TypeError),
    (lambda x, y: functional_ce.token_logprobs(x, y, teacher_logit_scale=2.0), "teacher_logit_scale", TypeError),
    (lambda x, y: functional_ce.linear_distillation_loss(x, torch.randn(7, 7), x, torch.randn(6, 7)),
     "vocabularies", ValueError),
    (lambda x, y: functional_ce.linear_distillation_loss(x, torch.randn(7, 5), x, torch.randn(7, 7)),
     "student", ValueError),
])
def test_bad_input_names_the_argument(call, match, error):
    x, y = torch.randn(4, 7), torch.randint(0, 7, (4,))
    with pytest.raises(error, match=match):
        call(x, y)


def _grpo_kd_loss(hidden, weight, labels, old_logp, adv, t_hidden, t_weight):
    """A GRPO clipped-ratio loss with an entropy bonus, plus a distillation term."""
    logp, ent = functional_ce.linear_token_logprobs(hidden, weight, labels, temperature=0.9, return_entropy=True)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    kd = functional_ce.linear_distillation_loss(hidden, weight, t_hidden, t_weight, labels=labels, beta=0.5)
    return pg.mean() - 0.01 * ent.mean() + kd


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_ladder_fullgraph_no_breaks_no_recompile_when_only_the_token_count_changes(backend):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_grpo_kd_loss, backend=counter, fullgraph=True, dynamic=None)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(31, 8, generator=g).requires_grad_()
    t_weight = torch.randn(31, 12, generator=g)
    for n in (10, 13, 17):
        hidden = torch.randn(n, 8, generator=g).requires_grad_()
        args = (torch.randint(0, 31, (n,), generator=g), torch.randn(n, generator=g) - 2, torch.randn(n, generator=g),
                torch.randn(n, 12, generator=g))
        got = compiled(hidden, weight, args[0], args[1], args[2], args[3], t_weight)
        want = _grpo_kd_loss(hidden, weight, args[0], args[1], args[2], args[3], t_weight)
        g_got = torch.autograd.grad(got, (hidden, weight))
        g_want = torch.autograd.grad(want, (hidden, weight))
        assert torch.allclose(got, want, atol=1e-5)
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a, b, atol=1e-5)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for 3 token counts (one dynamic recompile at most)"


def _compiled_vs_eager_calls():
    g = torch.Generator().manual_seed(5)
    n, v, h, ht = 37, 300, 16, 24
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / 3).bfloat16()
    t_hidden, t_weight = torch.randn(n, ht, generator=g).bfloat16(), (torch.randn(v, ht, generator=g) / 3).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::6] = -100
    logits = (hidden.float() @ weight.float().T).bfloat16()
    t_logits = (t_hidden.float() @ t_weight.float().T).bfloat16()
    up = torch.randn(n, generator=g)
    kw = dict(chunk_size=8)
    return {
        "token_logprobs": ((logits,), lambda x, cc: torch.stack(functional_ce.token_logprobs(
            x, labels, return_entropy=True, temperature=0.7, softcap=5.0, compile_chunks=cc, **kw)).mul(up).sum()),
        "linear_token_logprobs": ((hidden, weight), lambda x, w, cc: torch.stack(functional_ce.linear_token_logprobs(
            x, w, labels, return_entropy=True, temperature=1.3, compile_chunks=cc, **kw)).mul(up).sum()),
        "linear_token_logprobs_stats": ((hidden, weight), lambda x, w, cc: torch.stack(
            functional_ce.linear_token_logprobs(x, w, labels, return_entropy=True, temperature=0.8, softcap=4.0,
                                                logit_scale=1.5, stats=("mean_logits", "log_sum_sq_probs"),
                                                compile_chunks=cc, **kw)[:2]).mul(up).sum()),
        "distillation_loss": ((logits, t_logits), lambda s, t, cc: functional_ce.distillation_loss(
            s, t, labels=labels, beta=0.3, temperature=2.0, compile_chunks=cc, **kw)),
        "linear_distillation_loss": ((hidden, weight), lambda x, w, cc: functional_ce.linear_distillation_loss(
            x, w, t_hidden, t_weight, labels=labels, beta=0.5, compile_chunks=cc, **kw)),
        "distillation_loss_capped": ((logits, t_logits), lambda s, t, cc: functional_ce.distillation_loss(
            s, t, labels=labels, beta=0.0, temperature=0.8, softcap=3.0, teacher_softcap=5.0, logit_scale=1.5,
            compile_chunks=cc, **kw)),
        "linear_distillation_loss_capped": ((hidden, weight), lambda x, w, cc: functional_ce.linear_distillation_loss(
            x, w, t_hidden, t_weight, labels=labels, beta=1.0, softcap=4.0, teacher_softcap=2.0,
            teacher_logit_scale=0.5, compile_chunks=cc, **kw)),
    }


@pytest.mark.parametrize("name", ["token_logprobs", "linear_token_logprobs", "linear_token_logprobs_stats",
                                  "distillation_loss", "linear_distillation_loss", "distillation_loss_capped",
                                  "linear_distillation_loss_capped"])
def test_compiled_chunk_graphs_match_the_eager_chunk_maths(name):
    """The default path of an eager call runs each chunk through an inductor-compiled graph: it
    gives the eager chunk maths' values and gradients."""
    inputs, fn = _compiled_vs_eager_calls()[name]
    results = []
    for compile_chunks in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves, compile_chunks)
        grads = torch.autograd.grad(out, leaves[:1] if name.startswith("distillation_loss") else leaves)
        results.append((out.detach(), grads))
    (eager, g_eager), (compiled, g_compiled) = results
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5), (compiled, eager)
    for a, b in zip(g_compiled, g_eager):
        assert a.dtype == b.dtype == torch.bfloat16
        # the same fp32 maths, fused differently, then rounded to bf16 once
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_extra_statistics_compile_fullgraph_and_match_eager(backend):
    def fn(hidden, weight, labels):
        logp, ent, top1, sq, mean = functional_ce.linear_token_logprobs(
            hidden, weight, labels, return_entropy=True, logit_scale=0.5, stats=("is_top1", "log_sum_sq_probs",
                                                                                  "mean_logits"))
        return (logp + 0.1 * ent).sum(), top1, sq, mean

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(29, 8, generator=g).requires_grad_()
    hidden = torch.randn(11, 8, generator=g).requires_grad_()
    labels = torch.randint(0, 29, (11,), generator=g)
    labels[::4] = -100
    got, want = compiled(hidden, weight, labels), fn(hidden, weight, labels)
    assert torch.equal(got[1], want[1])
    for a, b in zip(got[::2] + got[3:], want[::2] + want[3:]):
        assert torch.allclose(a, b, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got[0], (hidden, weight)), torch.autograd.grad(want[0], (hidden, weight))):
        assert torch.allclose(a, b, atol=1e-5)
    assert counter.frame_count == 1
