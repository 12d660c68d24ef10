"""Token log-probs and distillation never build a tokens x vocabulary buffer beyond the logits'
own gradient (logits forms) and none at all (hidden-state forms); what autograd keeps from
forward to backward is the callers' tensors and O(N) fp32 statistics."""

from __future__ import annotations

import math

import pytest
import torch

import functional_ce
from tests.support.alloc_trace import saved_for_backward, trace_forward_and_backward

# N * V is larger than every legitimate buffer (a chunk of logits, a [V, H] weight gradient).
N, H, HT, V, CHUNK = 96, 8, 12, 1000, 16


def _hidden_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_()
    t_hidden = torch.randn(N, HT, generator=g).to(dtype)
    t_weight = (torch.randn(V, HT, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    return hidden, weight, t_hidden, t_weight, labels


def _logp_entropy_loss(out):
    logp, entropy = out
    up = torch.linspace(-1, 1, logp.numel())
    return (logp * up).sum() - 0.01 * entropy.sum()


HIDDEN_CALLS = {
    "linear_token_logprobs": lambda h, w, th, tw, y: _logp_entropy_loss(functional_ce.linear_token_logprobs(
        h, w, y, return_entropy=True, temperature=0.8, chunk_size=CHUNK, compile_chunks=False)),
    "linear_distillation_loss": lambda h, w, th, tw, y: functional_ce.linear_distillation_loss(
        h, w, th, tw, labels=y, beta=0.5, chunk_size=CHUNK, compile_chunks=False),
    "linear_distillation_loss recompute": lambda h, w, th, tw, y: functional_ce.linear_distillation_loss(
        h, w, th, tw, labels=y, beta=0.0, chunk_size=CHUNK, compile_chunks=False, recompute_logits_in_backward=True),
}


def _numel(shape) -> int:
    return math.prod(shape)


@pytest.mark.parametrize("call", list(HIDDEN_CALLS))
def test_hidden_state_forms_build_no_tokens_by_vocabulary_buffer(call):
    hidden, weight, t_hidden, t_weight, labels = _hidden_inputs()
    fwd, bwd = trace_forward_and_backward(lambda: HIDDEN_CALLS[call](hidden, weight, t_hidden, t_weight, labels))
    for phase, trace in (("forward", fwd), ("backward", bwd)):
        assert trace.records, f"the trace saw nothing in {phase}"
        too_big = [r for r in trace.records if _numel(r[1]) > max(CHUNK * V, V * HT)]
        assert not too_big, f"{phase} allocated {too_big[:3]}"
    # the chunk is the largest vocabulary-wide buffer, and it is really used
    assert (CHUNK, V) in {r[1] for r in fwd.records}
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_log_probs_forward_keeps_only_the_callers_tensors_and_row_statistics():
    """The per-token upstream gradient is unknown in forward: autograd keeps hidden, weight,
    labels and two fp32 values per row (the logsumexp and the entropy), nothing of size V x N."""
    hidden, weight, _, _, labels = _hidden_inputs()
    _, saved = saved_for_backward(lambda: functional_ce.linear_token_logprobs(
        hidden, weight, labels, return_entropy=True, chunk_size=CHUNK, compile_chunks=False))
    callers = {hidden.data_ptr(), weight.data_ptr()}
    big = [t for t in saved if t.numel() > 2 * N]
    assert {t.data_ptr() for t in big} <= callers, [(tuple(t.shape), t.dtype) for t in big]
    small = [t for t in saved if t.data_ptr() not in callers]
    assert sum(t.numel() * t.element_size() for t in small) <= N * (8 + 2 * 4) + 64


@pytest.mark.parametrize("teacher_grad", [False, True])
def test_distillation_from_logits_allocates_no_fp32_copy(teacher_grad):
    """The only [N, V] allocations are the gradients handed back, in the logits' dtype."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(N, V, generator=g).bfloat16().requires_grad_()
    teacher = torch.randn(N, V, generator=g).bfloat16().requires_grad_(teacher_grad)
    fwd, bwd = trace_forward_and_backward(
        lambda: functional_ce.distillation_loss(student, teacher, beta=0.5, chunk_size=CHUNK, compile_chunks=False)
    )
    assert not [r for r in fwd.records if _numel(r[1]) > CHUNK * V], fwd.records[:3]
    full = [r for r in bwd.records if _numel(r[1]) > CHUNK * V]
    assert sorted(r[1:] for r in full) == [((N, V), torch.bfloat16)] * (1 + teacher_grad), full
    assert (student.grad is not None) and ((teacher.grad is not None) == teacher_grad)
