"""The memory contract: what autograd saves, and what forward and backward allocate."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import functional_ce
from tests.alloc_trace import AllocationTrace

N, V, CHUNK = 64, 1000, 16


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, N // 4, V, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (4, N // 4), generator=g)
    return logits, labels


@pytest.mark.parametrize("kwargs", [{}, {"weights": True, "reduction": "mean", "z_loss": 1e-4, "softcap": 20.0}])
def test_autograd_saves_the_callers_logits_and_only_row_statistics(kwargs):
    logits, labels = _inputs()
    if kwargs.get("weights"):
        kwargs = dict(kwargs, weights=torch.rand(labels.shape))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = functional_ce.cross_entropy(logits, labels, chunk_size=CHUNK, **kwargs)
    big = [t for t in saved if t.numel() > N]
    assert len(big) == 1, f"expected only the logits to be saved, got shapes {[tuple(t.shape) for t in big]}"
    (logits_saved,) = big
    assert logits_saved.dtype == logits.dtype, "saved logits must keep the input dtype (no fp32 copy)"
    assert logits_saved.data_ptr() == logits.data_ptr(), "saved logits must be the caller's storage, not a copy"
    small_bytes = sum(t.numel() * t.element_size() for t in saved if t.numel() <= N)
    assert small_bytes <= 6 * 8 * N, f"row statistics take {small_bytes} bytes for N={N}: not O(N)"
    loss.backward()


@pytest.mark.parametrize("inplace", [False, True])
def test_forward_and_backward_allocate_at_most_chunk_sized_fp32_and_one_gradient(inplace):
    logits, labels = _inputs()
    with AllocationTrace() as fwd:
        loss = functional_ce.cross_entropy(
            logits, labels, chunk_size=CHUNK, inplace_grad=inplace, compile_chunks=False, z_loss=1e-4
        )
    with AllocationTrace() as bwd:
        loss.backward()
    assert fwd.records and bwd.records, "the trace saw nothing: the test would prove nothing"
    assert fwd.largest() <= CHUNK * V, f"forward allocated {fwd.largest()} elements > one chunk ({CHUNK * V})"
    full = bwd.with_numel(N * V)
    if inplace:
        assert full == [], f"in-place backward allocated an [N, V] tensor: {full}"
    else:
        assert len(full) == 1 and full[0][2] == torch.bfloat16, f"expected one bf16 [N, V] gradient, got {full}"
    chunk_sized = [r for r in bwd.records if r not in full]
    assert max(n for n in (_n(r[1]) for r in chunk_sized)) <= CHUNK * V


def _n(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def test_the_trace_sees_a_full_fp32_copy_in_the_naive_loss():
    """Control: the same trace catches the [N, V] fp32 tensors of the plain torch path."""
    logits, labels = _inputs()
    with AllocationTrace() as trace:
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    assert any(dtype == torch.float32 for _, _, dtype in trace.with_numel(N * V))
