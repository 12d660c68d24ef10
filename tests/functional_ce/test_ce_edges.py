"""Edge cases of cross_entropy: all-ignored rows, num_label_tokens, in-place gradient, double backward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import functional_ce
from tests.functional_ce.ce_cases import COMPILED_OPTIONS, COMPILED_V, DTYPES, PATHS, loss_and_grad, make_case

ALL_ON = COMPILED_OPTIONS[1]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("how", ["ignore_index", "mask", "empty"])
def test_nothing_to_learn_gives_zero_loss_and_zero_grad(reduction, how, path):
    n = 0 if how == "empty" else 9
    logits = torch.randn(n, COMPILED_V, requires_grad=True)
    labels = torch.full((n,), ALL_ON["ignore_index"]) if how == "ignore_index" else torch.randint(0, 3, (n,))
    mask = torch.zeros(n, dtype=torch.bool) if how == "mask" else None
    loss = functional_ce.cross_entropy(
        logits, labels, mask=mask, reduction=reduction, chunk_size=4, compile_chunks=PATHS[path], **ALL_ON
    )
    assert torch.isfinite(loss).all()
    assert torch.count_nonzero(loss) == 0
    loss.sum().backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad) == 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("count", [0, 0.0, torch.tensor(0), torch.tensor(7.0), 7, torch.tensor(3, dtype=torch.int32)])
def test_num_label_tokens_is_the_denominator_of_the_summed_loss(count, reduction):
    """With "mean" it replaces the valid-token count; with "sum" it divides the sum: the same result."""
    case = make_case(3, (4, 5), COMPILED_V, torch.float32)
    summed, g_sum = loss_and_grad(functional_ce.cross_entropy, case, reduction="sum")
    ours, g = loss_and_grad(functional_ce.cross_entropy, case, num_label_tokens=count, reduction=reduction)
    n = float(count)
    if n == 0:
        assert ours.item() == 0 and torch.count_nonzero(g) == 0
    else:
        torch.testing.assert_close(ours, summed / n)
        torch.testing.assert_close(g, g_sum / n)


def test_mean_is_over_valid_tokens_and_weights_scale_tokens():
    logits = torch.randn(6, 5)
    labels = torch.tensor([0, 1, -100, 3, -100, 4])
    w = torch.tensor([1.0, 2.0, 5.0, 0.5, 5.0, 1.0])
    per = F.cross_entropy(logits, labels, reduction="none")
    got = functional_ce.cross_entropy(logits, labels, weights=w, compile_chunks=False)
    torch.testing.assert_close(got, (per * w).sum() / 4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_grad_writes_into_the_logits_storage(dtype, path):
    case = make_case(5, (3, 7), COMPILED_V, dtype, **ALL_ON)
    _, expected = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=4, compile_chunks=PATHS[path])
    logits = case.logits.detach().clone().requires_grad_()
    ptr = logits.data_ptr()
    out = functional_ce.cross_entropy(
        logits, case.labels, chunk_size=4, inplace_grad=True, compile_chunks=PATHS[path], **case.kwargs
    )
    up = torch.rand(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * up.to(out.dtype)).sum().backward()
    assert logits.grad.data_ptr() == ptr, "the gradient must live in the logits' storage"
    assert torch.equal(logits.grad, expected)
    assert torch.equal(logits.detach(), expected), "documented: the logits are overwritten by their gradient"


def test_inplace_grad_on_a_view_of_model_output():
    """The usual case: logits come out of a matmul; the gradient still flows on correctly."""
    h = torch.randn(2, 6, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (2, 6))
    ref = functional_ce.cross_entropy(h @ w.T, labels, compile_chunks=False)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    loss = functional_ce.cross_entropy(h @ w.T, labels, inplace_grad=True, compile_chunks=False)
    gh, gw = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(gh, gh_ref)
    torch.testing.assert_close(gw, gw_ref)


@pytest.mark.parametrize("inplace_grad", [False, True])
@pytest.mark.parametrize("how", ["grad of grad", "backward of grad"])
def test_double_backward_raises_a_clear_error(inplace_grad, how):
    """First-order gradients with create_graph=True are right; differentiating them raises."""
    logits = torch.randn(4, 9, requires_grad=True)
    labels = torch.randint(0, 9, (4,))
    (expected,) = torch.autograd.grad(F.cross_entropy(logits, labels), logits)
    x = logits.detach().clone().requires_grad_()
    loss = functional_ce.cross_entropy(x, labels, inplace_grad=inplace_grad, compile_chunks=False)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    torch.testing.assert_close(g, expected)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        if how == "grad of grad":
            torch.autograd.grad(g.pow(2).sum(), x)
        else:
            g.sum().backward()


def test_logits_without_grad_give_a_plain_value():
    logits = torch.randn(4, 9)
    labels = torch.randint(0, 9, (4,))
    got = functional_ce.cross_entropy(logits, labels, compile_chunks=False)
    assert not got.requires_grad
    torch.testing.assert_close(got, F.cross_entropy(logits, labels))


def test_gradient_flows_to_weights():
    logits = torch.randn(5, 9)
    labels = torch.randint(0, 9, (5,))
    w = torch.rand(5, requires_grad=True)
    functional_ce.cross_entropy(logits, labels, weights=w, reduction="sum", compile_chunks=False).backward()
    torch.testing.assert_close(w.grad, F.cross_entropy(logits, labels, reduction="none"))


def test_import_does_not_pull_in_transformers():
    code = "import sys, functional_ce; sys.exit(1 if 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
