"""The hidden-state loss honours whatever upstream gradient reaches it, on both of its paths
(gradients computed in forward and scaled in backward, or logits recomputed in backward), and
rows without a loss cost no matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_ce
from tests.functional_ce.linear_cases import make_linear_case
from tests.support.alloc_trace import AllocationTrace

RECOMPUTE = {"grads-in-forward": False, "recompute": True}
OPTS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0, chunk_size=5, compile_chunks=False)


def _leaves(case):
    return [t.detach().clone().requires_grad_() for t in (case.hidden, case.weight, case.bias)]


def _ours(leaves, case, recompute, **kw):
    h, w, b = leaves
    return functional_ce.linear_cross_entropy(h, w, case.labels, bias=b, recompute_logits_in_backward=recompute,
                                              **dict(OPTS, **kw))


def _reference(leaves, case, **kw):
    """The same loss through materialised fp64 logits."""
    h, w, b = leaves
    logits = F.linear(h.double(), w.double(), b.double())
    kw = dict(OPTS, **kw)
    kw.pop("compile_chunks"), kw.pop("chunk_size")
    return functional_ce.cross_entropy(logits.float(), case.labels, compile_chunks=False, **kw)


def _grads(fn):
    """Gradients that ``fn(leaves)`` accumulates into fresh leaves (``fn`` runs its own backward)."""
    case = make_linear_case(21, (3, 8), 12, 40, torch.float32, bias=True)
    leaves = _leaves(case)
    fn(leaves, case)
    return [t.grad for t in leaves]


STEPS = {
    "scaled loss": lambda loss_of, leaves, case: (loss_of(leaves, case) * -3.5).backward(),
    "loss used twice": lambda loss_of, leaves, case: (
        lambda loss: (loss * 2.0 + loss.pow(2)).backward()
    )(loss_of(leaves, case)),
    "explicit grad_outputs": lambda loss_of, leaves, case: torch.autograd.backward(
        loss_of(leaves, case), grad_tensors=torch.tensor(0.25)
    ),
    "two accumulation micro-steps": lambda loss_of, leaves, case: [
        (loss_of(leaves, case, num_label_tokens=n) * s).backward() for n, s in ((17, 1.0), (9, 0.5))
    ],
}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("path", RECOMPUTE)
def test_the_upstream_gradient_is_honoured(step, path):
    def ours(leaves, case, **kw):
        return _ours(leaves, case, RECOMPUTE[path], **kw)

    got = _grads(lambda leaves, case: STEPS[step](ours, leaves, case))
    want = _grads(lambda leaves, case: STEPS[step](_reference, leaves, case))
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_reduction_none_with_a_non_uniform_upstream_gradient():
    case = make_linear_case(22, (2, 9), 12, 40, torch.float32, bias=True)
    up = torch.rand(2, 9, generator=torch.Generator().manual_seed(3)) * 4 - 2
    got_leaves, want_leaves = _leaves(case), _leaves(case)
    (_ours(got_leaves, case, False, reduction="none") * up).sum().backward()
    (_reference(want_leaves, case, reduction="none") * up).sum().backward()
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g.grad, w.grad.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", RECOMPUTE)
def test_retain_graph_gives_the_same_gradients_twice(path):
    case = make_linear_case(23, (10,), 12, 40, torch.float32, bias=True)
    leaves = _leaves(case)
    loss = _ours(leaves, case, RECOMPUTE[path])
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss * 2, leaves)
    for a, b in zip(first, second):
        torch.testing.assert_close(b, 2 * a)


def test_both_paths_agree_and_weights_get_their_gradient():
    case = make_linear_case(24, (4, 6), 12, 40, torch.bfloat16, bias=True, mask=True)
    token_w = torch.rand(4, 6, generator=torch.Generator().manual_seed(5)).requires_grad_()
    results = []
    for recompute in (False, True):
        leaves = _leaves(case) + [token_w.detach().clone().requires_grad_()]
        loss = _ours(leaves[:3], case, recompute, reduction="mean", weights=leaves[3], mask=case.kwargs["mask"])
        loss.backward()
        results.append((loss.detach(), [t.grad for t in leaves]))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=1e-2)


def _matmul_flops(labels, recompute):
    case = make_linear_case(25, (64,), 32, 256, torch.float32, bias=False)
    h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
    with AllocationTrace() as trace:
        functional_ce.linear_cross_entropy(h, w, labels, chunk_size=16, compile_chunks=False,
                                           recompute_logits_in_backward=recompute).backward()
    return trace.flops


@pytest.mark.parametrize("path", RECOMPUTE)
def test_ignored_rows_cost_no_matmul(path):
    """Matmul FLOPs follow the rows that carry a loss: 3 N H V in forward-gradient mode, 4 N H V
    with recompute, for N the number of valid rows."""
    labels = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(6))
    half = labels.clone()
    half[::2] = -100
    full_flops, half_flops = _matmul_flops(labels, RECOMPUTE[path]), _matmul_flops(half, RECOMPUTE[path])
    per_row_matmuls = 4 if RECOMPUTE[path] else 3
    assert full_flops == per_row_matmuls * 2 * 64 * 32 * 256
    assert half_flops == full_flops // 2
