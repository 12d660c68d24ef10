"""torch.compile: the compile ladder around a user loss, and the compiled chunk graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import functional_ce
from functional_ce import compiled
from tests.ce_cases import ROUNDING, loss_and_grad, make_case

V = 96
OPTS = dict(reduction="mean", z_loss=1e-4, label_smoothing=0.1, softcap=30.0, chunk_size=8)


def _user_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a training loop compiles: a head projection, then our loss."""
    logits = (hidden @ weight.T).to(torch.bfloat16)
    return functional_ce.cross_entropy(logits, labels, compile_chunks=False, **OPTS)


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = -100
    return hidden, labels


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_ladder_fullgraph_no_breaks_one_recompile(backend):
    torch._dynamo.reset()
    counters.clear()
    weight = torch.randn(V, 16, generator=torch.Generator().manual_seed(9), requires_grad=True)
    counter = CompileCounterWithBackend(backend)
    compiled_loss = torch.compile(_user_loss, backend=counter, fullgraph=True)
    for step, n in enumerate([24, 37, 53]):  # only the token count changes between steps
        hidden, labels = _batch(n, step)
        ref = _user_loss(hidden, weight, labels)
        ref_grads = torch.autograd.grad(ref, (hidden, weight))
        got = compiled_loss(hidden, weight, labels)
        got_grads = torch.autograd.grad(got, (hidden, weight))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(got_grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-4)
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 3 token counts (at most 2 allowed)"


def test_inplace_grad_inside_torch_compile_keeps_logits_and_matches():
    logits = torch.randn(12, V, dtype=torch.bfloat16, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, V, (12,))
    fn = torch.compile(
        lambda x, y: functional_ce.cross_entropy(x, y, inplace_grad=True, compile_chunks=False),
        backend="aot_eager", fullgraph=True,
    )
    fn(logits, labels).backward()
    (expected,) = torch.autograd.grad(functional_ce.cross_entropy(before.requires_grad_(), labels), before)
    assert torch.equal(logits.grad, expected)
    assert torch.equal(logits.detach(), before.detach()), "documented: ignored under compile, logits intact"


def test_compiled_chunk_graphs_match_eager_chunk_maths():
    """The default eager path runs inductor-compiled chunk graphs; they agree with the eager maths."""
    for seed, n in enumerate([40, 29]):  # a second token count reuses the dynamic-row graphs
        case = make_case(seed, (n,), 300, torch.bfloat16, **{k: v for k, v in OPTS.items() if k != "chunk_size"})
        ours, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=True)
        ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=False)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=0, atol=ROUNDING[torch.bfloat16])
    assert not compiled._broken, f"chunk graphs fell back to eager: {compiled._broken}"


def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def broken(name):
        def fail(*args, **kwargs):
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(compiled, "_compiled", broken)
    monkeypatch.setattr(compiled, "_broken", set())
    case = make_case(0, (10,), 50, torch.float32)
    with caplog.at_level(logging.WARNING, logger="functional_ce.compiled"):
        got, g = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=True)
    ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=False)
    assert torch.equal(got, ref) and torch.equal(g, g_ref)
    assert "no compiler here" in caplog.text and "FUNCTIONAL_CE_COMPILE=0" in caplog.text
    assert compiled._broken == {"_forward_into", "_backward_into"}


def test_environment_opt_out(monkeypatch):
    calls = []
    monkeypatch.setattr(compiled, "_compiled", lambda name: calls.append(name))
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")
    functional_ce.cross_entropy(torch.randn(3, 5, requires_grad=True), torch.tensor([0, 1, 2])).backward()
    assert calls == []
