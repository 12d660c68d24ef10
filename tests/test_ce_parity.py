"""cross_entropy against an fp64 reference of the documented semantics and against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import functional_ce
from tests.ce_cases import DTYPES, ROUNDING, Case, absmax, loss_and_grad, make_case, worst
from tests.reference import reference_cross_entropy


def _check_against_truth(case: Case, chunk_size, atol_scale: float = 1.0) -> None:
    """|ours - truth| <= |naive low-precision - truth| + tol, for the loss and the gradient."""
    ours, g_ours = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunk_size)
    truth, g_truth = loss_and_grad(reference_cross_entropy, case)
    # What a user would get without this library: the fp32 definition, gradient in the input dtype.
    naive, g_naive = loss_and_grad(reference_cross_entropy, case, dtype=torch.float32)
    dtype = case.logits.dtype
    assert ours.dtype == torch.float32
    tol = 1e-5 * (1 + absmax(truth)) * atol_scale
    excess = worst((ours.double() - truth).abs() - (naive.double() - truth).abs() - tol)
    assert excess <= 0, f"loss exceeds the fp32 reference's error by {excess:.3g}"
    assert g_ours.dtype == dtype and g_ours.shape == case.logits.shape
    g_naive = g_naive.to(dtype).double()  # the gradient a user gets back in the input dtype
    gtol = ROUNDING[dtype] * (1 + absmax(g_truth)) * atol_scale
    gexcess = worst((g_ours.double() - g_truth).abs() - (g_naive - g_truth).abs() - gtol)
    assert gexcess <= 0, f"gradient exceeds the low-precision reference's error by {gexcess:.3g}"


options = st.fixed_dictionaries(
    {},
    optional={
        "reduction": st.sampled_from(["sum", "mean", "none"]),
        "label_smoothing": st.sampled_from([0.0, 0.1, 0.5, 1.0]),
        "z_loss": st.sampled_from([0.0, 1e-4, 0.1]),
        "softcap": st.sampled_from([None, 5.0, 30.0]),
        "mask": st.just(True),
        "weights": st.just(True),
        "ignore_index": st.sampled_from([-100, -1, 3]),
    },
)


@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    v=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    chunk=st.one_of(st.none(), st.just("auto"), st.integers(1, 40)),
    opts=options,
    label_dtype=st.sampled_from([torch.int64, torch.int32]),
    transposed=st.booleans(),
)
def test_matches_fp64_reference(seed, batch_shape, v, dtype, chunk, opts, label_dtype, transposed):
    if opts.get("ignore_index", -100) >= v:
        opts["ignore_index"] = -100
    if opts.get("reduction", "sum") == "sum" and seed % 3 == 0:
        opts["num_label_tokens"] = seed % 5  # includes 0
    case = make_case(seed, batch_shape, v, dtype, label_dtype=label_dtype, transposed=transposed, **opts)
    _check_against_truth(case, chunk)


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 64),
    v=st.integers(2, 257),
    dtype=st.sampled_from(DTYPES),
    reduction=st.sampled_from(["sum", "mean", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.2]),
    chunk=st.integers(1, 16),
)
def test_matches_torch_cross_entropy(seed, n, v, dtype, reduction, label_smoothing, chunk):
    """Where torch's function has the same options, the results agree to fp32 rounding."""
    case = make_case(seed, (n,), v, dtype)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    ours, g_ours = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunk, **kw)

    def torch_ce(x, y, **k):
        return F.cross_entropy(x.float(), y.long(), ignore_index=-100, **k)

    ref, g_ref = loss_and_grad(torch_ce, case, **kw)
    if reduction == "mean" and bool((case.labels == -100).all()):
        ref = torch.zeros_like(ref)  # torch gives nan here; ours is documented to give 0
        g_ref = torch.zeros_like(g_ref)
    torch.testing.assert_close(ours, ref.float(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=ROUNDING[dtype])


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 50),
    v=st.integers(1, 200),
    dtype=st.sampled_from(DTYPES),
    chunks=st.tuples(st.one_of(st.none(), st.integers(1, 60)), st.one_of(st.just("auto"), st.integers(1, 60))),
    opts=options,
)
def test_result_does_not_depend_on_chunk_size(seed, n, v, dtype, chunks, opts):
    if opts.get("ignore_index", -100) >= v:
        opts["ignore_index"] = -100
    case = make_case(seed, (n,), v, dtype, **opts)
    a, ga = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunks[0])
    b, gb = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunks[1])
    # Rows are independent and reductions run over the full [N] vector: chunking changes nothing.
    assert torch.equal(a, b)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_and_masked_logits_are_finite_and_exact(dtype):
    """Logits of +-1e4 and -inf in non-target columns give finite results equal to the reference."""
    v = 64
    big = 6e4 if dtype == torch.float16 else 1e4
    logits = torch.randn(24, v, generator=torch.Generator().manual_seed(0))
    logits[::3, 5] = big
    logits[1::3, 7] = -big
    logits[2::3, 10:20] = float("-inf")
    labels = torch.arange(24) % 5  # never a -inf column
    case = Case(logits.to(dtype).requires_grad_(), labels, {"z_loss": 1e-4})
    ours, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=5)
    assert torch.isfinite(ours).all() and torch.isfinite(g).all()
    _check_against_truth(case, 5)
    case.kwargs["softcap"] = 30.0
    _check_against_truth(case, 7)


def test_label_smoothing_with_minus_inf_is_infinite_as_in_torch():
    logits = torch.zeros(2, 4)
    logits[:, 3] = float("-inf")
    labels = torch.tensor([0, 1])
    ours = functional_ce.cross_entropy(logits, labels, label_smoothing=0.1)
    ref = F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum")
    assert ours.item() == ref.item() == float("inf")
