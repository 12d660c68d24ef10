"""CUDA-only checks of cross_entropy (skipped cleanly without a GPU): bf16 parity, in-place
gradient aliasing and its memory, and inductor-compiled chunk graphs on the device.

Each test says which chunk path it runs (``compile_chunks=True``: the default compiled chunk
graphs; ``False``: the eager chunk maths) and bounds memory by what that path holds."""

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


#: Rows per chunk for the memory checks: one fp32 chunk is 256 x 32000 x 4 = 31 MiB, an eighth
#: of the bf16 logits (250 MiB).
CHUNK = 256


@pytest.mark.parametrize("compile_chunks", [True, False], ids=["compiled", "eager"])
def test_inplace_gradient_aliases_the_logits_and_allocates_no_full_buffer(compile_chunks):
    logits, labels = _case()
    x = logits.clone().requires_grad_()
    functional_ce.cross_entropy(x, labels, chunk_size=CHUNK, compile_chunks=compile_chunks).backward()
    expected = x.grad
    del x
    y = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    functional_ce.cross_entropy(
        y, labels, chunk_size=CHUNK, inplace_grad=True, compile_chunks=compile_chunks
    ).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert y.grad.data_ptr() == y.data_ptr()
    torch.testing.assert_close(y.grad, expected, rtol=0, atol=0)
    fp32_chunk = CHUNK * logits.shape[1] * 4
    # Compiled graphs hold no fp32 chunk (O(N) statistics only); the eager maths a few chunks.
    bound = fp32_chunk / 2 if compile_chunks else 6 * fp32_chunk
    assert peak < bound, f"in-place backward peaked {peak / 2**20:.0f} MiB above inputs (bound {bound / 2**20:.0f})"
    assert peak < logits.numel() * logits.element_size(), "an [N, V] buffer was allocated"


def test_user_compile_on_cuda_inductor_fullgraph():
    logits, labels = _case(n=1024, v=8192)
    fn = torch.compile(
        lambda a, b: functional_ce.cross_entropy(a, b, z_loss=1e-4, compile_chunks=True), fullgraph=True
    )
    x = logits.clone().requires_grad_()
    fn(x, labels).backward()
    r = logits.clone().requires_grad_()
    functional_ce.cross_entropy(r, labels, z_loss=1e-4, compile_chunks=False).backward()
    torch.testing.assert_close(x.grad.float(), r.grad.float(), rtol=0, atol=1e-2)
