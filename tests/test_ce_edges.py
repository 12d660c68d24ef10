"""Edge cases of cross_entropy: all-ignored rows, num_label_tokens, in-place gradient, double backward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import functional_ce
from tests.ce_cases import DTYPES, make_case, loss_and_grad


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("how", ["ignore_index", "mask", "empty"])
def test_nothing_to_learn_gives_zero_loss_and_zero_grad(reduction, how):
    n = 0 if how == "empty" else 9
    logits = torch.randn(n, 11, requires_grad=True)
    labels = torch.full((n,), -100) if how == "ignore_index" else torch.randint(0, 11, (n,))
    mask = torch.zeros(n, dtype=torch.bool) if how == "mask" else None
    loss = functional_ce.cross_entropy(logits, labels, mask=mask, reduction=reduction, z_loss=0.1, chunk_size=4)
    assert torch.isfinite(loss).all()
    assert torch.count_nonzero(loss) == 0
    loss.sum().backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad) == 0


@pytest.mark.parametrize("count", [0, torch.tensor(0), torch.tensor(7.0), 7])
def test_num_label_tokens_divides_the_sum(count):
    case = make_case(3, (4, 5), 17, torch.float32)
    summed, g_sum = loss_and_grad(functional_ce.cross_entropy, case)
    ours, g = loss_and_grad(functional_ce.cross_entropy, case, num_label_tokens=count)
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
    got = functional_ce.cross_entropy(logits, labels, weights=w, reduction="mean")
    torch.testing.assert_close(got, (per * w).sum() / 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_grad_writes_into_the_logits_storage(dtype):
    case = make_case(5, (3, 7), 50, dtype, z_loss=1e-3, label_smoothing=0.1)
    _, expected = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=4)
    logits = case.logits.detach().clone().requires_grad_()
    ptr = logits.data_ptr()
    out = functional_ce.cross_entropy(logits, case.labels, chunk_size=4, inplace_grad=True, **case.kwargs)
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
    ref = functional_ce.cross_entropy(h @ w.T, labels)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    loss = functional_ce.cross_entropy(h @ w.T, labels, inplace_grad=True)
    gh, gw = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(gh, gh_ref)
    torch.testing.assert_close(gw, gw_ref)


def test_double_backward_raises_a_clear_error():
    logits = torch.randn(4, 9, requires_grad=True)
    loss = functional_ce.cross_entropy(logits, torch.randint(0, 9, (4,)))
    (g,) = torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_logits_without_grad_give_a_plain_value():
    logits = torch.randn(4, 9)
    labels = torch.randint(0, 9, (4,))
    got = functional_ce.cross_entropy(logits, labels)
    assert not got.requires_grad
    torch.testing.assert_close(got, F.cross_entropy(logits, labels, reduction="sum"))


def test_gradient_flows_to_weights():
    logits = torch.randn(5, 9)
    labels = torch.randint(0, 9, (5,))
    w = torch.rand(5, requires_grad=True)
    functional_ce.cross_entropy(logits, labels, weights=w).backward()
    torch.testing.assert_close(w.grad, F.cross_entropy(logits, labels, reduction="none"))


def test_import_does_not_pull_in_transformers():
    code = "import sys, functional_ce; sys.exit(1 if 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
