"""CUDA-only checks of cross_entropy (skipped cleanly without a GPU): bf16 parity, in-place
gradient aliasing, and inductor-compiled chunk graphs on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_ce

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(n=4096, v=32000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n, v, device="cuda", generator=g) * 3).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::7] = -100
    return logits, labels


@pytest.mark.parametrize("compile_chunks", [False, True])
def test_bf16_matches_torch_on_cuda(compile_chunks):
    logits, labels = _case()
    x = logits.clone().requires_grad_()
    loss = functional_ce.cross_entropy(x, labels, reduction="mean", compile_chunks=compile_chunks)
    loss.backward()
    r = logits.float().requires_grad_()
    ref = F.cross_entropy(r, labels, reduction="mean")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.float(), r.grad, rtol=0, atol=2e-2 * r.grad.abs().max().item())


def test_inplace_gradient_aliases_the_logits_and_allocates_no_full_buffer():
    logits, labels = _case()
    expected = None
    x = logits.clone().requires_grad_()
    functional_ce.cross_entropy(x, labels).backward()
    expected = x.grad
    y = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    functional_ce.cross_entropy(y, labels, inplace_grad=True).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert y.grad.data_ptr() == y.data_ptr()
    assert torch.equal(y.grad, expected)
    assert peak < logits.numel() * logits.element_size() / 2, f"in-place backward peaked {peak} bytes above inputs"


def test_user_compile_on_cuda_inductor_fullgraph():
    logits, labels = _case(n=1024, v=8192)
    fn = torch.compile(lambda a, b: functional_ce.cross_entropy(a, b, z_loss=1e-4), fullgraph=True)
    x = logits.clone().requires_grad_()
    fn(x, labels).backward()
    r = logits.clone().requires_grad_()
    functional_ce.cross_entropy(r, labels, z_loss=1e-4).backward()
    torch.testing.assert_close(x.grad.float(), r.grad.float(), rtol=0, atol=1e-2)
