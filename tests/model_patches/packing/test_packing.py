"""The packing oracle on real tiny HF models: a packed row equals each of its documents run alone.

Every case also runs stock Transformers on the same batch first (negative control): the oracle
must see the leak there, or it could not see one with the patches either.
Flash attention runs on CPU through ``model_patches.testing`` (Transformers' real flash path,
kernels replaced by per-sequence SDPA). FlexAttention has no CPU backward in torch, so its
gradient case runs only where CUDA is available.
"""

from __future__ import annotations

import functools

import pytest
import torch

from model_patches import enable_packing
from model_patches.testing.packing_oracle import (
    BACKENDS,
    FAMILIES_UNDER_TEST,
    grad_gap,
    logits_gap,
    packed_batch,
    tiny_model,
)

FAMILIES = list(FAMILIES_UNDER_TEST)
TOL = 1e-4  # fp32, max |packed - per-document|
LEAK = 1e-2  # stock must be at least this far off, or the control proves nothing


@functools.lru_cache(maxsize=None)
def _model(family: str) -> torch.nn.Module:
    return tiny_model(family)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    b = packed_batch()
    assert b["input_ids"].shape[0] > 1 and (b["attention_mask"] == 0).any()  # batch > 1, with padding
    assert (b["attention_mask"].max(dim=1).values > 1).any()  # some row holds several documents
    return b


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_documents_alone(family: str, implementation: str, batch) -> None:
    model = _model(family).eval()
    stock = logits_gap(model, batch, implementation, use_cache=False)
    assert stock > LEAK, f"stock Transformers did not leak ({stock:.3g}); the oracle cannot see a leak"
    with enable_packing():
        for use_cache in (False, True):
            gap = logits_gap(model, batch, implementation, use_cache=use_cache)
            assert gap <= TOL, f"{family}/{implementation} use_cache={use_cache}: packed differs by {gap:.3g}"
    assert logits_gap(model, batch, "eager") > LEAK  # handle removed: stock behaviour is back


def _grad_backends() -> list[str]:
    return [b for b in BACKENDS if b != "flex_attention" or torch.cuda.is_available()]


@pytest.mark.parametrize("implementation", _grad_backends())
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_gradients_equal_summed_document_gradients(family: str, implementation: str, batch) -> None:
    model = _model(family).train()
    try:
        stock, scale = grad_gap(model, batch, implementation)
        assert stock > LEAK * scale, f"stock gradients did not leak ({stock:.3g} vs scale {scale:.3g})"
        with enable_packing():
            gap, scale = grad_gap(model, batch, implementation, use_cache=(implementation == "sdpa"))
    finally:
        model.eval()
    assert gap <= TOL * max(1.0, scale), f"{family}/{implementation}: gradient gap {gap:.3g} (scale {scale:.3g})"


def test_flex_backward_on_cpu_is_a_torch_limit() -> None:
    """Documents why the flex gradient case needs CUDA: torch itself refuses, patches or not."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the flex gradient case runs in the test above")
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_flash_attention_3_takes_the_same_per_document_path(family: str, batch) -> None:
    model = _model(family).eval()
    assert logits_gap(model, batch, "flash_attention_3") > LEAK
    with enable_packing():
        gap = logits_gap(model, batch, "flash_attention_3")
    assert gap <= TOL, f"{family}/flash_attention_3: packed differs by {gap:.3g}"


def _hand_made_batch() -> dict[str, torch.Tensor]:
    """Left padding, padding between documents, reused document ids across rows."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3], [1, 1, 1, 0, 0, 2, 2, 2, 2, 2, 0, 0]])
    positions = torch.zeros_like(mask)
    for r in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            same_run = i > 0 and mask[r, i] == mask[r, i - 1] and mask[r, i] != 0
            positions[r, i] = positions[r, i - 1] + 1 if same_run else 0
    ids = torch.randint(1, 128, mask.shape, generator=torch.Generator().manual_seed(3))
    labels = torch.where((mask == 0) | (positions == 0), -100, ids)  # no label crosses documents
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


_PAD_CASES = [(f, b) for f in ("llama", "gemma3") for b in ("eager", "sdpa", "flash_attention_2")]


@pytest.mark.parametrize("family, implementation", [*_PAD_CASES, ("llama", "flex_attention")])
def test_padding_anywhere(family: str, implementation: str) -> None:
    """Also guards against Transformers' position_ids packing detection, which (with pads at
    position 0 and no cache) remaps mask-function indices to positions."""
    model, batch = _model(family), _hand_made_batch()
    with enable_packing():
        for use_cache in (False, True):
            gap = logits_gap(model.eval(), batch, implementation, use_cache=use_cache)
            assert gap <= TOL, f"{family}/{implementation} use_cache={use_cache}: packed differs by {gap:.3g}"
        if implementation == "sdpa":
            try:
                grad, scale = grad_gap(model.train(), batch, implementation)
            finally:
                model.eval()
            assert grad <= TOL * max(1.0, scale)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_masks_of_every_dtype_keep_documents_apart(dtype: torch.dtype, implementation: str, batch) -> None:
    """``batch["attention_mask"].float()`` (or bf16) is an indexed mask too, never a bool cast."""
    model = _model("llama").eval()
    cast = {**batch, "attention_mask": batch["attention_mask"].to(dtype)}
    assert logits_gap(model, cast, implementation) > LEAK  # stock casts it to bool: documents leak
    with enable_packing():
        gap = logits_gap(model, cast, implementation)
    assert gap <= TOL, f"{dtype}/{implementation}: packed differs by {gap:.3g}"
