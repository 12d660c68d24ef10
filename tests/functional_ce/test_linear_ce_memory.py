"""The hidden-state loss never allocates or saves an [N, V] tensor, in forward or backward.

Two paths: by default (scalar reduction, gradients required) forward computes the gradients and
keeps them, backward only scales them; with ``recompute_logits_in_backward=True`` (and with
``reduction="none"``) forward keeps O(N) statistics and backward recomputes each chunk."""

from __future__ import annotations

import pytest
import torch

import functional_ce
from bench.harness.rss_peak import peak_extra_bytes
from tests.functional_ce.ce_cases import PATHS
from tests.support.alloc_trace import AllocationTrace, saved_for_backward, trace_forward_and_backward

# N * V is larger than every legitimate buffer (V * H weight gradient, chunk x V logits).
N, H, V, CHUNK = 96, 8, 1000, 16


def _inputs(dtype=torch.bfloat16, bias=True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, N // 4, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (4, N // 4), generator=g)
    return hidden, weight, b, labels


@pytest.mark.parametrize("recompute", [False, True], ids=["grads-in-forward", "recompute"])
@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum", "z_loss": 1e-4, "softcap": 20.0, "label_smoothing": 0.1}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_allocation_of_tokens_times_vocab(kwargs, dtype, recompute):
    hidden, weight, bias, labels = _inputs(dtype)
    fwd, bwd = trace_forward_and_backward(lambda: functional_ce.linear_cross_entropy(
        hidden, weight, labels, bias=bias, chunk_size=CHUNK, compile_chunks=False,
        recompute_logits_in_backward=recompute, **kwargs
    ))
    for phase, trace in (("forward", fwd), ("backward", bwd)):
        assert trace.records, f"the trace saw nothing in {phase}; it does not open the operators"
        too_big = [r for r in trace.records if _numel(r[1]) > max(CHUNK * V, V * H)]
        assert not too_big, f"{phase} allocated {too_big[:3]}"
    # The chunk really is the largest vocabulary-wide buffer, and the weight gradient is
    # accumulated in fp32 (one [V, H] fp32 buffer) before it is returned in the weight dtype,
    # in backward when it recomputes, in forward otherwise (backward then builds no chunk).
    grad_phase = bwd if recompute else fwd
    assert (CHUNK, V) in {r[1] for r in grad_phase.records}
    assert any(r[1] == (V, H) and r[2] == torch.float32 for r in grad_phase.records)
    if not recompute:
        assert not [r for r in bwd.records if _numel(r[1]) >= CHUNK * V], f"backward built chunks: {bwd.records}"
    assert weight.grad.dtype == dtype and hidden.grad.dtype == dtype and bias.grad.dtype == dtype


def test_forward_keeps_only_the_gradients_and_row_statistics():
    """Default path: what autograd holds from forward to backward is the callers' tensors, one
    gradient per input (input dtype, no fp32 accumulator) and O(N) fp32 rows."""
    hidden, weight, bias, labels = _inputs()
    _, saved = saved_for_backward(lambda: functional_ce.linear_cross_entropy(
        hidden, weight, labels, bias=bias, chunk_size=CHUNK, compile_chunks=False))
    callers = {hidden.data_ptr(), weight.data_ptr(), bias.data_ptr()}
    new = sorted(((tuple(t.shape), t.dtype) for t in saved if t.data_ptr() not in callers), key=str)
    assert new == sorted([((N,), torch.float32), ((N, H), hidden.dtype), ((V, H), weight.dtype), ((V,), bias.dtype)],
                         key=str), new


def test_autograd_saves_only_the_callers_tensors_and_row_statistics():
    hidden, weight, bias, labels = _inputs()
    _, saved = saved_for_backward(lambda: functional_ce.linear_cross_entropy(
        hidden, weight, labels, bias=bias, chunk_size=CHUNK, compile_chunks=False,
        recompute_logits_in_backward=True,
    ))
    big = [t for t in saved if t.numel() > N]
    ptrs = {t.data_ptr() for t in big}
    assert ptrs == {hidden.data_ptr(), weight.data_ptr(), bias.data_ptr()}, (
        f"expected only hidden, weight and bias (no copies), got {[(tuple(t.shape), t.dtype) for t in big]}"
    )
    small = [t for t in saved if t.numel() <= N]
    assert sum(t.numel() * t.element_size() for t in small) <= N * (8 + 4 + 4) + 64


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("path", PATHS)
def test_peak_memory_stays_far_below_one_logits_tensor(path):
    """Resident-memory peaks, which also see inside compiled chunk graphs: forward and backward
    each hold the hidden and weight gradients (fp32 accumulator included) plus a few chunks."""
    n, h, v, chunk = 2048, 64, 4096, 64
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.2).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    kw = dict(chunk_size=chunk, compile_chunks=PATHS[path], z_loss=1e-4)

    def leaves():
        return hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    hh, ww = leaves()
    functional_ce.linear_cross_entropy(hh, ww, labels, **kw).backward()  # compile and warm up
    hh, ww = leaves()
    loss, fwd = peak_extra_bytes(lambda: functional_ce.linear_cross_entropy(hh, ww, labels, **kw))
    _, bwd = peak_extra_bytes(loss.backward)
    fp32_chunk = chunk * v * 4
    grads = n * h * 2 + v * h * (4 + 2)  # hidden gradient, fp32 weight accumulator, weight gradient
    logits_bf16 = n * v * 2
    assert fwd <= grads + 6 * fp32_chunk, f"forward peaked {fwd / 2**20:.1f} MiB"
    assert bwd <= grads + 8 * fp32_chunk, f"backward peaked {bwd / 2**20:.1f} MiB"
    assert max(fwd, bwd) < logits_bf16 / 2


def test_backward_of_the_default_path_allocates_only_the_scaled_gradients():
    """Backward scales the kept gradients by the upstream gradient: one new tensor per input,
    in the input's shape and dtype, and nothing else of vocabulary or token size (no
    zero-filled gradients for the operator's non-differentiable outputs)."""
    hidden, weight, bias, labels = _inputs()
    loss = functional_ce.linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=CHUNK,
                                              compile_chunks=False)
    with AllocationTrace() as bwd:
        (2.0 * loss).backward()
    big = sorted(((r[1], r[2]) for r in bwd.records if _numel(r[1]) >= min(N, V)), key=str)
    assert big == sorted([((N, H), hidden.dtype), ((V, H), weight.dtype), ((V,), bias.dtype)], key=str), big


def test_backward_of_a_unit_gradient_copies_no_weight_gradient():
    """``loss.backward()`` on CPU hands the gradients computed in forward on without a second
    [V, H] buffer, and the parameter's .grad is that buffer; any other scale, and a retained graph
    run twice, still give the scaled, accumulated gradients."""
    hidden, weight, bias, labels = _inputs(torch.float32)
    call = lambda: functional_ce.linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=CHUNK,  # noqa: E731
                                                      compile_chunks=False)
    fwd, bwd = trace_forward_and_backward(call)
    assert any(r[1] == (V, H) for r in fwd.records)
    assert not [r for r in bwd.records if r[1] in ((V, H), (N // 4, 4, H), (4, N // 4, H))], bwd.records
    once = weight.grad.clone()
    for p in (hidden, weight, bias):
        p.grad = None
    (call() * 3.0).backward()
    torch.testing.assert_close(weight.grad, 3 * once)
    for p in (hidden, weight, bias):
        p.grad = None
    loss = call()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * once)
