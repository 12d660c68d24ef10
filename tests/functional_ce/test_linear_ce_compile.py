"""torch.compile around a user loss calling linear_cross_entropy, and the compiled chunk graphs."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import functional_ce
from functional_ce import compiled_chunks as compiled
from tests.functional_ce.ce_cases import ROUNDING
from tests.functional_ce.linear_cases import linear_loss_and_grads, make_linear_case

H, V = 16, 96
OPTS = dict(reduction="mean", z_loss=1e-4, label_smoothing=0.1, softcap=30.0, chunk_size=8)


def _user_loss(hidden, weight, bias, labels):
    """What a training loop compiles: a final norm, then our loss from hidden states (default path)."""
    hidden = torch.nn.functional.layer_norm(hidden, (H,))
    return functional_ce.linear_cross_entropy(hidden, weight, labels, bias=bias, **OPTS)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_ladder_fullgraph_no_breaks_one_recompile(backend, monkeypatch):
    monkeypatch.delenv("FUNCTIONAL_CE_COMPILE", raising=False)  # the default path: compiled chunks
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(9)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_user_loss, backend=counter, fullgraph=True)
    for step, n in enumerate([24, 37, 53]):  # only the token count changes between steps
        hidden = torch.randn(n, H, generator=g, requires_grad=True)
        labels = torch.randint(0, V, (n,), generator=g)
        labels[::5] = -100
        ref = _user_loss(hidden, weight, bias, labels)
        ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
        got = compiled(hidden, weight, bias, labels)
        got_grads = torch.autograd.grad(got, (hidden, weight, bias))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 3 token counts (at most 2 allowed)"


def test_compiled_chunk_graphs_match_the_eager_ones():
    """The default path (chunk graphs compiled by inductor) equals the eager chunk maths."""
    case = make_linear_case(4, (2, 19), H, V, torch.bfloat16, bias=True, z_loss=1e-3, softcap=20.0)
    before = set(compiled.compiled_configurations())
    eager, g_eager = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, chunk_size=8, compile_chunks=False)
    comp, g_comp = linear_loss_and_grads(functional_ce.linear_cross_entropy, case, chunk_size=8, compile_chunks=True)
    served = compiled.compiled_configurations()
    assert all(served[k] >= 1 for k in set(served) - before), "a chunk graph fell back to eager"
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=ROUNDING[torch.bfloat16])
