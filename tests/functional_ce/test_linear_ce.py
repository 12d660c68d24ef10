"""linear_cross_entropy against an fp64 reference of cross_entropy(hidden @ weight.T + bias)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import functional_ce
from tests.functional_ce.ce_cases import COMPILED_OPTIONS, DTYPES, PATHS, ROUNDING, absmax, worst
from tests.functional_ce.linear_cases import LinearCase, linear_loss_and_grads, make_linear_case, reference_linear


def _check_against_truth(case: LinearCase, chunk_size, compile_chunks: bool) -> None:
    """|ours - truth| <= |naive low-precision - truth| + tol for the loss and all three gradients."""
    ours, g_ours = linear_loss_and_grads(
        functional_ce.linear_cross_entropy, case, chunk_size=chunk_size, compile_chunks=compile_chunks
    )
    truth, g_truth = linear_loss_and_grads(reference_linear, case)
    # What a user gets without this library: F.linear in the input dtype, the loss in fp32.
    naive, g_naive = linear_loss_and_grads(reference_linear, case, dtype=None)
    dtype = case.hidden.dtype
    assert ours.dtype == torch.float32
    tol = 1e-5 * (1 + absmax(truth))
    excess = worst((ours.double() - truth).abs() - (naive.double() - truth).abs() - tol)
    assert excess <= 0, f"loss exceeds the naive path's error by {excess:.3g}"
    for name, g, gt, gn, leaf in zip(("hidden", "weight", "bias"), g_ours, g_truth, g_naive,
                                     (case.hidden, case.weight, case.bias)):
        if leaf is None:
            continue
        assert g.dtype == dtype and g.shape == leaf.shape, f"grad {name}: {g.dtype} {tuple(g.shape)}"
        gtol = ROUNDING[dtype] * (1 + absmax(gt))
        gexcess = worst((g.double() - gt).abs() - (gn.double() - gt).abs() - gtol)
        assert gexcess <= 0, f"grad {name} exceeds the naive path's error by {gexcess:.3g}"


options = st.fixed_dictionaries(
    {},
    optional={
        "reduction": st.sampled_from(["mean", "sum", "none"]),
        "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
        "z_loss": st.sampled_from([0.0, 1e-3]),
        "softcap": st.sampled_from([None, 4.0, 30.0]),
        "mask": st.just(True),
        "weights": st.just(True),
        "ignore_index": st.sampled_from([-100, 2]),
    },
)


@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=st.sampled_from([(1,), (13,), (40,), (3, 7), (2, 2, 5)]),
    h=st.sampled_from([1, 8, 24]),
    v=st.sampled_from([1, 7, 64, 130]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    chunk_size=st.sampled_from([None, 1, 5, 16, "auto"]),
    opts=options,
)
def test_eager_path_matches_fp64_reference(seed, batch_shape, h, v, dtype, bias, chunk_size, opts):
    opts = dict(opts)
    if opts.get("ignore_index", -100) >= v:
        opts["ignore_index"] = -100
    case = make_linear_case(seed, batch_shape, h, v, dtype, bias=bias, **opts)
    _check_against_truth(case, chunk_size, compile_chunks=False)


@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=st.sampled_from([(1,), (13,), (40,), (3, 7), (2, 2, 5)]),
    dtype=st.sampled_from(DTYPES),
    chunk_size=st.sampled_from([None, 1, 5, 16, "auto"]),
    graph_opts=st.sampled_from(COMPILED_OPTIONS),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    mask=st.booleans(),
    weights=st.booleans(),
)
def test_compiled_path_matches_fp64_reference(seed, batch_shape, dtype, chunk_size, graph_opts, reduction, mask,
                                              weights):
    """The default path (compiled chunk graphs), at one head shape so the suite compiles a few graphs."""
    case = make_linear_case(seed, batch_shape, 8, 64, dtype, bias=True, reduction=reduction, mask=mask or None,
                            weights=weights or None, **graph_opts)
    _check_against_truth(case, chunk_size, compile_chunks=True)


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 50),
    dtype=st.sampled_from(DTYPES),
    chunks=st.lists(st.sampled_from([1, 3, 8, 17, 64]), min_size=2, max_size=2, unique=True),
)
@pytest.mark.parametrize("path", PATHS)
def test_result_does_not_depend_on_chunk_size(seed, n, dtype, chunks, path):
    case = make_linear_case(seed, (n,), 8, 64, dtype, bias=True, reduction="none", **COMPILED_OPTIONS[1])
    kw = dict(compile_chunks=PATHS[path])
    a, ga = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, chunk_size=chunks[0], **kw)
    b, gb = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, chunk_size=chunks[1], **kw)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, x, y in zip(("hidden", "weight", "bias"), ga, gb):
        # Per-row gradients are chunk-local; weight/bias sums only regroup fp32 partials.
        tol = 1e-5 if dtype == torch.float32 else ROUNDING[dtype] * (1 + absmax(y.float()))
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=tol,
                                   msg=lambda m: f"grad {name}: {m}")


def test_equals_cross_entropy_of_the_projected_logits_with_all_options():
    case = make_linear_case(3, (4, 9), 16, 33, torch.float32, bias=True, mask=True, weights=True)
    kw = dict(reduction="sum", num_label_tokens=11, label_smoothing=0.2, z_loss=1e-3, softcap=8.0, chunk_size=5,
              compile_chunks=False)

    def via_logits(hidden, weight, labels, *, bias, **kwargs):
        return functional_ce.cross_entropy(F.linear(hidden, weight, bias), labels, **kwargs)

    a, ga = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, **kw)
    b, gb = linear_loss_and_grads(via_logits, case, **kw)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_matches_torch_linear_cross_entropy():
    case = make_linear_case(5, (37,), 24, 101, torch.float32, bias=True)
    for reduction in ("mean", "sum", "none"):
        ours = functional_ce.linear_cross_entropy(
            case.hidden, case.weight, case.labels, bias=case.bias, reduction=reduction, label_smoothing=0.1, chunk_size=8,
            compile_chunks=False,
        )
        theirs = F.linear_cross_entropy(
            case.hidden, case.weight, case.labels, linear_bias=case.bias, reduction=reduction, label_smoothing=0.1
        )
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_hidden_gradient_is_unchanged():
    case = make_linear_case(7, (20,), 8, 40, torch.bfloat16)
    _, (gh_all, _, _) = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, chunk_size=6,
                                              compile_chunks=False)
    hidden = case.hidden.clone().requires_grad_()
    weight = case.weight.clone()  # frozen
    loss = functional_ce.linear_cross_entropy(hidden, weight, case.labels, chunk_size=6, compile_chunks=False)
    up = torch.rand((), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (loss * up.float()).backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, gh_all, rtol=0, atol=0)


def test_tied_weight_receives_both_gradients():
    """A weight used as embedding and as head gets the sum of both gradients (autograd's job)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(30, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 30, (12,), generator=g)
    labels = torch.randint(0, 30, (12,), generator=g)
    ours = functional_ce.linear_cross_entropy(torch.tanh(emb[ids]), emb, labels, chunk_size=5, compile_chunks=False)
    (g_ours,) = torch.autograd.grad(ours, emb)
    ref = F.cross_entropy(torch.tanh(emb[ids]) @ emb.T, labels)
    (g_ref,) = torch.autograd.grad(ref, emb)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_no_valid_label_gives_zero_loss_and_zero_gradients(dtype, recompute):
    """No chunk runs, so the weight-gradient accumulator (written by the first chunk) is zeroed."""
    case = make_linear_case(1, (6,), 8, 10, dtype, ignore_frac=1.0)
    for reduction in ("sum", "mean"):
        out, grads = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, reduction=reduction,
                                           compile_chunks=False, recompute_logits_in_backward=recompute)
        assert out.item() == 0.0
        assert all(bool((g == 0).all()) for g in grads if g is not None)


def test_double_backward_raises_a_clear_error():
    case = make_linear_case(2, (5,), 4, 9, torch.float32)
    hidden = case.hidden.requires_grad_()
    weight = case.weight.requires_grad_()
    loss = functional_ce.linear_cross_entropy(hidden, weight, case.labels, compile_chunks=False)
    (gh,) = torch.autograd.grad(loss, hidden, create_graph=True)
    (expected,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, case.labels), hidden)
    torch.testing.assert_close(gh, expected)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        gh.sum().backward()


def test_module_form_holds_the_options_and_owns_no_parameters():
    case = make_linear_case(9, (3, 6), 8, 40, torch.float32, bias=True, mask=True)
    opts = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=8.0, chunk_size=4, compile_chunks=False)
    module = functional_ce.LinearCrossEntropyLoss(**opts)
    assert list(module.parameters()) == [] and "softcap=8.0" in repr(module)
    got, g_got = linear_loss_and_grads(lambda h, w, y, bias, mask: module(h, w, y, bias, mask=mask), case)
    want, g_want = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, **opts)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(g_got, g_want))
    assert functional_ce.LinearCrossEntropyLoss().reduction == "mean"


def test_autocast_casts_like_f_linear_and_returns_gradients_in_the_parameters_dtype():
    case = make_linear_case(8, (3, 11), 16, 70, torch.float32, bias=True, z_loss=1e-3)
    leaves = [t.detach().clone().requires_grad_() for t in (case.hidden, case.weight, case.bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = functional_ce.linear_cross_entropy(leaves[0], leaves[1], case.labels, bias=leaves[2], chunk_size=5,
                                                 z_loss=1e-3, compile_chunks=False)
    got_grads = torch.autograd.grad(got, leaves)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (case.hidden, case.weight, case.bias)]
    want = functional_ce.linear_cross_entropy(low[0], low[1], case.labels, bias=low[2], chunk_size=5, z_loss=1e-3,
                                              compile_chunks=False)
    want_grads = torch.autograd.grad(want, low)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w.float(), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("v", [50, 32768, 128256, 1_000_000])
def test_auto_chunks_aim_for_efficient_rows_within_the_memory_cap(v, device):
    from functional_ce.spec import linear_auto_chunk, resolve_chunk_size

    auto_rows, auto_bytes = linear_auto_chunk(torch.device(device))
    rows = resolve_chunk_size("auto", 100_000, v * 4, auto_bytes, auto_rows)
    assert 1 <= rows <= auto_rows
    assert rows * v * 4 <= auto_bytes or rows == 1, "one fp32 chunk stays within the cap"
    if auto_rows * v * 4 <= auto_bytes:
        assert rows == auto_rows, "small vocabularies get the efficient row count"
    assert resolve_chunk_size("auto", 7, v * 4, auto_bytes, auto_rows) == min(7, rows)


def test_auto_chunks_on_cuda_are_larger_than_on_cpu():
    """The CUDA rule (bench/RESULTS.md, GPU chunk sweep): 2048 rows of a 128K vocabulary, where
    the CPU rule takes 128 (64 MiB of fp32)."""
    from functional_ce.spec import linear_auto_chunk, resolve_chunk_size

    def rows(device):
        auto_rows, auto_bytes = linear_auto_chunk(torch.device(device))
        return resolve_chunk_size("auto", 100_000, 128256 * 4, auto_bytes, auto_rows)

    assert rows("cuda") == 2048
    assert rows("cpu") == 128
