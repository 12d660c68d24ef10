"""cross_entropy against an fp64 reference of the documented semantics and against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import functional_ce
from tests.functional_ce.ce_cases import (
    COMPILED_OPTIONS,
    COMPILED_V,
    DTYPES,
    PATHS,
    ROUNDING,
    Case,
    absmax,
    loss_and_grad,
    make_case,
    worst,
)
from tests.support.reference import reference_cross_entropy


def _check_against_truth(case: Case, chunk_size, compile_chunks: bool, atol_scale: float = 1.0) -> None:
    """|ours - truth| <= |naive low-precision - truth| + tol, for the loss and the gradient."""
    ours, g_ours = loss_and_grad(
        functional_ce.cross_entropy, case, chunk_size=chunk_size, compile_chunks=compile_chunks
    )
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
        "reduction": st.sampled_from(["mean", "sum", "none"]),
        "label_smoothing": st.sampled_from([0.0, 0.1, 0.5, 1.0]),
        "z_loss": st.sampled_from([0.0, 1e-4, 0.1]),
        "softcap": st.sampled_from([None, 5.0, 30.0]),
        "mask": st.just(True),
        "weights": st.just(True),
        "ignore_index": st.sampled_from([-100, -1, 3]),
    },
)


#: Options that do not change the compiled chunk graphs (they act in the eager shell).
shell_options = st.fixed_dictionaries(
    {},
    optional={
        "reduction": st.sampled_from(["mean", "sum", "none"]),
        "mask": st.just(True),
        "weights": st.just(True),
    },
)
batch_shapes = st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)
chunks = st.one_of(st.none(), st.just("auto"), st.integers(1, 40))


def _with_count(opts: dict, seed: int) -> dict:
    """Every third example divides a scalar reduction by an explicit count (0 included)."""
    if opts.get("reduction", "mean") != "none" and seed % 3 == 0:
        opts["num_label_tokens"] = seed % 5
    return opts


@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=batch_shapes,
    v=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    chunk=chunks,
    opts=options,
    label_dtype=st.sampled_from([torch.int64, torch.int32]),
    transposed=st.booleans(),
)
def test_eager_path_matches_fp64_reference(seed, batch_shape, v, dtype, chunk, opts, label_dtype, transposed):
    if opts.get("ignore_index", -100) >= v:
        opts["ignore_index"] = -100
    case = make_case(seed, batch_shape, v, dtype, label_dtype=label_dtype, transposed=transposed,
                     **_with_count(opts, seed))
    _check_against_truth(case, chunk, compile_chunks=False)


@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=batch_shapes,
    dtype=st.sampled_from(DTYPES),
    chunk=chunks,
    graph_opts=st.sampled_from(COMPILED_OPTIONS),
    opts=shell_options,
    label_dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_compiled_path_matches_fp64_reference(seed, batch_shape, dtype, chunk, graph_opts, opts, label_dtype):
    """The default path: inductor-compiled chunk graphs, against the same fp64 truth."""
    case = make_case(seed, batch_shape, COMPILED_V, dtype, label_dtype=label_dtype,
                     **_with_count(dict(opts, **graph_opts), seed))
    _check_against_truth(case, chunk, compile_chunks=True)


@pytest.mark.parametrize("path", PATHS)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 64),
    v=st.integers(2, 257),
    dtype=st.sampled_from(DTYPES),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.2]),
    chunk=st.integers(1, 16),
)
def test_matches_torch_cross_entropy(path, seed, n, v, dtype, reduction, label_smoothing, chunk):
    """Where torch's function has the same options, the results agree to fp32 rounding."""
    if path == "compiled":  # bounded set of compiled graphs: one vocabulary, default options
        v, label_smoothing = COMPILED_V, 0.0
    case = make_case(seed, (n,), v, dtype)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    ours, g_ours = loss_and_grad(
        functional_ce.cross_entropy, case, chunk_size=chunk, compile_chunks=PATHS[path], **kw
    )

    def torch_ce(x, y, **k):
        return F.cross_entropy(x.float(), y.long(), ignore_index=-100, **k)

    ref, g_ref = loss_and_grad(torch_ce, case, **kw)
    if reduction == "mean" and bool((case.labels == -100).all()):
        ref = torch.zeros_like(ref)  # torch gives nan here; ours is documented to give 0
        g_ref = torch.zeros_like(g_ref)
    torch.testing.assert_close(ours, ref.float(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=ROUNDING[dtype])


@pytest.mark.parametrize("path", PATHS)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 50),
    v=st.integers(1, 200),
    dtype=st.sampled_from(DTYPES),
    chunks=st.tuples(st.one_of(st.none(), st.integers(1, 60)), st.one_of(st.just("auto"), st.integers(1, 60))),
    opts=options,
    graph_opts=st.sampled_from(COMPILED_OPTIONS),
)
def test_result_does_not_depend_on_chunk_size(path, seed, n, v, dtype, chunks, opts, graph_opts):
    if path == "compiled":  # bounded set of compiled graphs
        v = COMPILED_V
        opts = dict({k: opts[k] for k in ("reduction", "mask", "weights") if k in opts}, **graph_opts)
    if opts.get("ignore_index", -100) >= v:
        opts["ignore_index"] = -100
    case = make_case(seed, (n,), v, dtype, **opts)
    a, ga = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunks[0], compile_chunks=PATHS[path])
    b, gb = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=chunks[1], compile_chunks=PATHS[path])
    # Rows are independent and reductions run over the full [N] vector: chunking changes nothing
    # in the eager maths. Compiled, a one-row chunk (a chunk_size of 1, or the last rows) is its own
    # graph (inductor specialises size 1) whose kernels may round a gradient element differently:
    # one rounding at most.
    assert torch.equal(a, b)
    if path == "eager":
        assert torch.equal(ga, gb)
    else:
        torch.testing.assert_close(ga, gb, rtol=0, atol=ROUNDING[dtype] * (1 + absmax(ga)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_and_masked_logits_are_finite_and_exact(dtype, path):
    """Logits of +-1e4 and -inf in non-target columns give finite results equal to the reference."""
    v = COMPILED_V
    big = 6e4 if dtype == torch.float16 else 1e4
    logits = torch.randn(24, v, generator=torch.Generator().manual_seed(0))
    logits[::3, 5] = big
    logits[1::3, 7] = -big
    logits[2::3, 10:20] = float("-inf")
    labels = torch.arange(24) % 5  # never a -inf column
    compile_chunks = PATHS[path]
    for opts in COMPILED_OPTIONS:
        case = Case(logits.to(dtype).requires_grad_(), labels, dict(opts))
        ours, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=5, compile_chunks=compile_chunks)
        assert torch.isfinite(ours).all() and torch.isfinite(g).all()
        _check_against_truth(case, 5, compile_chunks)
        _check_against_truth(case, 7, compile_chunks)


def test_label_smoothing_with_minus_inf_is_infinite_as_in_torch():
    logits = torch.zeros(2, 4)
    logits[:, 3] = float("-inf")
    labels = torch.tensor([0, 1])
    ours = functional_ce.cross_entropy(logits, labels, label_smoothing=0.1, compile_chunks=False)
    ref = F.cross_entropy(logits, labels, label_smoothing=0.1)
    assert ours.item() == ref.item() == float("inf")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_defaults_are_torch_defaults(dtype, path):
    """``cross_entropy(x, y)`` is ``F.cross_entropy(x.float(), y)``: mean over valid tokens, -100 ignored."""
    case = make_case(11, (3, 9), COMPILED_V, dtype)
    ours, g_ours = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=PATHS[path])
    ref, g_ref = loss_and_grad(lambda x, y: F.cross_entropy(x.float().flatten(0, -2), y.flatten()), case)
    assert ours.shape == ref.shape == ()
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=ROUNDING[dtype])


def test_module_form_holds_the_options_and_equals_the_function():
    case = make_case(12, (4, 5), 19, torch.bfloat16, mask=True, weights=True, ignore_index=2)
    opts = dict(ignore_index=2, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=8.0, chunk_size=3,
                compile_chunks=False)
    module = functional_ce.CrossEntropyLoss(**opts)
    assert isinstance(module, torch.nn.Module) and list(module.parameters()) == []
    assert "label_smoothing=0.1" in repr(module)
    per_call = dict(mask=case.kwargs["mask"], weights=case.kwargs["weights"], num_label_tokens=7)
    got, g_got = loss_and_grad(lambda x, y: module(x, y, **per_call), Case(case.logits, case.labels, {}))
    want, g_want = loss_and_grad(functional_ce.cross_entropy, Case(case.logits, case.labels, dict(opts, **per_call)))
    assert torch.equal(got, want) and torch.equal(g_got, g_want)
    assert functional_ce.CrossEntropyLoss().reduction == "mean"
