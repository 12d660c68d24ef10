"""The memory contract: what autograd saves, and what forward and backward allocate."""

from __future__ import annotations

import pytest
import torch

import functional_ce
from bench.harness.rss_peak import peak_extra_bytes
from tests.functional_ce.ce_cases import PATHS
from tests.support.alloc_trace import AllocationTrace, saved_for_backward, trace_forward_and_backward

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
    loss, saved = saved_for_backward(
        lambda: functional_ce.cross_entropy(logits, labels, chunk_size=CHUNK, compile_chunks=False, **kwargs)
    )
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
    """Every allocation of the eager chunk maths, opened up operator by operator."""
    logits, labels = _inputs()
    fwd, bwd = trace_forward_and_backward(lambda: functional_ce.cross_entropy(
        logits, labels, chunk_size=CHUNK, inplace_grad=inplace, compile_chunks=False, z_loss=1e-4
    ))
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


# Resident-memory peaks: the only way to see inside the compiled chunk graphs (a dispatch mode
# makes dynamo fall back to eager). Sizes make one fp32 chunk (1 MiB) small next to the gradient
# (bf16, 16 MiB) and to a full fp32 copy (32 MiB).
RN, RV, RCHUNK = 2048, 4096, 64
MiB = 2**20
FP32_CHUNK = RCHUNK * RV * 4


def _rss_inputs():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(RN, RV, generator=g) * 3).bfloat16()
    labels = torch.randint(0, RV, (RN,), generator=g)
    return logits, labels


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("path", PATHS)
def test_peak_memory_of_forward_and_backward(path, inplace):
    """Compiled chunk graphs hold no fp32 chunk at all; the eager chunk maths a few at most."""
    logits, labels = _rss_inputs()
    kw = dict(chunk_size=RCHUNK, inplace_grad=inplace, compile_chunks=PATHS[path], z_loss=1e-4)

    def step(x):
        loss = functional_ce.cross_entropy(x, labels, **kw)
        loss.backward()
        return loss

    step(logits.clone().requires_grad_())  # compile and warm up outside the measurement
    x = logits.clone().requires_grad_()
    loss, fwd = peak_extra_bytes(lambda: functional_ce.cross_entropy(x, labels, **kw))
    _, bwd = peak_extra_bytes(loss.backward)
    grad_bytes = 0 if inplace else logits.numel() * logits.element_size()
    chunks = 0.5 if path == "compiled" else 8  # compiled: less than one fp32 chunk, O(N) statistics aside
    assert fwd <= chunks * FP32_CHUNK + MiB // 2, f"forward peaked {fwd / MiB:.1f} MiB"
    assert bwd <= grad_bytes + chunks * FP32_CHUNK + MiB // 2, f"backward peaked {bwd / MiB:.1f} MiB"
    if inplace:
        assert x.grad.data_ptr() == x.data_ptr()


def test_peak_memory_control_sees_the_fp32_copy_of_the_naive_loss():
    logits, labels = _rss_inputs()
    x = logits.clone().requires_grad_()
    _, peak = peak_extra_bytes(lambda: torch.nn.functional.cross_entropy(x.float(), labels).backward())
    assert peak >= RN * RV * 4, f"the measurement missed a {RN * RV * 4 / MiB:.0f} MiB fp32 copy: {peak / MiB:.1f}"
