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
    # Compile the in-place configuration first: compiling (GPU kernel autotuning clones the
    # buffers a kernel writes) is a one-off cost that the steady-state bound below excludes.
    warm = logits[: 2 * CHUNK].clone().requires_grad_()
    functional_ce.cross_entropy(
        warm, labels[: 2 * CHUNK], chunk_size=CHUNK, inplace_grad=True, compile_chunks=compile_chunks
    ).backward()
    del warm
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


def _linear_case(n=1536, h=256, v=5000, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * h**-0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("recompute", [False, True], ids=["grads-in-forward", "recompute"])
@pytest.mark.parametrize("fp32_out_matmul", [True, False], ids=["fp32-out-matmul", "bf16-partial-fold"])
def test_linear_bf16_on_cuda_matches_fp64(monkeypatch, recompute, fp32_out_matmul):
    """Both weight-gradient accumulations (cuBLAS adding into the fp32 accumulator, and the bf16
    partial folded by a compiled kernel) give the fp64 reference's loss and gradients, over
    several chunks with ignored rows."""
    from functional_ce import driver as linear_ops

    key = ("cuda", torch.bfloat16)
    if fp32_out_matmul and not linear_ops.fp32_out_matmul_supported(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} has no fp32-output bf16 matmul on CUDA")
    monkeypatch.setitem(linear_ops._FP32_OUT_MATMUL, key, fp32_out_matmul)
    hidden, weight, labels = _linear_case()
    x = hidden.cuda().bfloat16().requires_grad_()
    w = weight.cuda().bfloat16().requires_grad_()
    loss = functional_ce.linear_cross_entropy(x, w, labels.cuda(), chunk_size=512,
                                              recompute_logits_in_backward=recompute)
    (3.0 * loss).backward()
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    ref = F.cross_entropy(xr @ wr.T, labels)
    (3.0 * ref).backward()
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-4, atol=1e-4)
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert got.dtype == torch.bfloat16
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= 1e-2 * want.abs().max().item(), f"gradient off by {err:.3g}"
