"""``torch.compile`` under ``enable_packing``: one graph, no breaks, no recompiles across layouts.

The mask path reads every integer mask as document ids (no ``mask.max()`` on the host), so a
packed batch and an ordinary padding batch both trace with ``fullgraph=True``, and a second
batch with another document layout of the same shape reuses the graph. Compiled outputs are
checked against the eager patched forward, which the oracle tests check against each document
run alone.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from model_patches import enable_packing
from model_patches.testing import use_attention
from model_patches.testing.packing_oracle import logits_gap, packed_batch, tiny_model


@functools.lru_cache(maxsize=None)
def _model() -> torch.nn.Module:
    return tiny_model("llama", seed=2)


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """Two batches of one shape [3, 12] with different layouts (packed) or pad counts (padded)."""
    first, second = packed_batch(seed=0), packed_batch(seed=1, lengths=(9, 3, 5, 6, 2, 4, 3))
    assert first["input_ids"].shape == second["input_ids"].shape
    if kind == "padded":
        for b, pads in ((first, 3), (second, 5)):
            b["attention_mask"] = torch.ones_like(b["attention_mask"])
            b["attention_mask"][-1, -pads:] = 0
            b["position_ids"] = None
    return [first, second]


def _forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_fullgraph_one_graph_per_shape(implementation: str, kind: str) -> None:
    model = use_attention(_model().eval(), implementation)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(functools.partial(_forward, model), backend=counter, fullgraph=True)
    with enable_packing(), torch.no_grad():
        for b in _batches(kind):
            got = compiled(b["input_ids"], b["attention_mask"], b["position_ids"])
            want = _forward(model, b["input_ids"], b["attention_mask"], b["position_ids"])
            real = b["attention_mask"] != 0
            gap = float((got - want)[real].abs().max())
            assert gap <= 1e-5, f"compiled differs from eager by {gap:.3g}"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for one input shape (recompiled)"
    if kind == "packed":  # and the eager patched forward really is the per-document result
        with enable_packing():
            assert logits_gap(model, _batches(kind)[1], implementation) <= 1e-4


def test_compiled_training_step_keeps_documents_apart() -> None:
    """Forward and backward through AOTAutograd (fullgraph) equal the eager patched step."""
    model = use_attention(_model(), "sdpa").train()
    b = _batches("packed")[0]

    def step(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = fn(b["input_ids"], b["attention_mask"], b["position_ids"])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        with enable_packing():
            eager_loss, eager_grads = step(functools.partial(_forward, model))
            loss, grads = step(torch.compile(functools.partial(_forward, model), backend=counter, fullgraph=True))
    finally:
        model.eval()
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
