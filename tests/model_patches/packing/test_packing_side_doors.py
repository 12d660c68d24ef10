"""Ways documents used to leak around the indexed mask, each now correct or refused.

- position-id packing (``DataCollatorWithFlattening``, TRL ``padding_free``: no mask, positions
  restarting at every document) while a cache exists (``use_cache`` left at its default), and on
  flash attention with more than one row;
- packed ``position_ids`` together with a 0/1 (or all-ones) 2D mask;
- absolute position embeddings (GPT-2) with an indexed mask and no ``position_ids``;
- families packing still refuses (stateful mixers it does not run per document, models with
  their own masks) under plain ``enable_packing()``, by mask or by packed ``position_ids``.
Each case runs stock Transformers first and requires it to leak (the control).
"""

from __future__ import annotations

import functools

import pytest
import torch

from model_patches import enable_packing
from model_patches.testing import use_attention
from model_patches.testing.family_sweep import tiny_causal_lm
from model_patches.testing.packing_oracle import logits_gap, packed_batch

TOL, LEAK = 1e-4, 1e-2
_LENGTHS = (5, 4, 3)


@functools.lru_cache(maxsize=None)
def _model(family: str) -> torch.nn.Module:
    return tiny_causal_lm(family, "eager", seed=3)


def _flattened() -> tuple[torch.Tensor, torch.Tensor]:
    """One row of three documents: input_ids [1, 12] and restarting position_ids, no mask."""
    ids = torch.randint(3, 128, (1, sum(_LENGTHS)), generator=torch.Generator().manual_seed(5))
    return ids, torch.cat([torch.arange(n) for n in _LENGTHS])[None]


def _gap(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> float:
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, **kwargs).logits[0]
        start, gaps = 0, []
        for n in _LENGTHS:
            alone = model(input_ids=ids[:, start : start + n], use_cache=False).logits[0]
            gaps.append(float((got[start : start + n] - alone).abs().max()))
            start += n
    return max(gaps)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_position_id_packing_with_a_cache(implementation: str, train: bool) -> None:
    model = use_attention(_model("llama"), implementation).train(train)
    ids, positions = _flattened()
    try:
        assert _gap(model, ids, positions, use_cache=True) > LEAK  # stock: a cache turns detection off
        with enable_packing():
            assert _gap(model, ids, positions, use_cache=True) <= TOL
            assert _gap(model, ids, positions, use_cache=False) <= TOL
    finally:
        model.eval()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_packed_positions_with_a_padding_mask(implementation: str) -> None:
    model = use_attention(_model("llama"), implementation)
    ids, positions = _flattened()
    for mask in (torch.ones_like(ids), torch.ones_like(ids, dtype=torch.float32)):
        assert _gap(model, ids, positions, attention_mask=mask, use_cache=False) > LEAK
        with enable_packing():
            assert _gap(model, ids, positions, attention_mask=mask, use_cache=False) <= TOL


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3"])
def test_position_id_packing_on_flash_attention_with_several_rows(implementation: str) -> None:
    """Transformers' flash path reads packed ``position_ids`` at batch size 1 only: two packed rows
    ran causal attention over each whole row. With packing, each row's documents are apart."""
    from model_patches.testing import cpu_flash_attention

    model = use_attention(_model("llama"), implementation)
    ids, positions = _flattened()
    rows, places = torch.cat([ids, ids.flip(1)]), torch.cat([positions, positions])

    def gap() -> float:
        with torch.no_grad():
            got, gaps = model(input_ids=rows, position_ids=places, use_cache=False).logits, []
            for r in range(2):
                start = 0
                for n in _LENGTHS:
                    alone = model(input_ids=rows[r : r + 1, start : start + n], use_cache=False).logits[0]
                    gaps.append(float((got[r, start : start + n] - alone).abs().max()))
                    start += n
        return max(gaps)

    with cpu_flash_attention():
        assert gap() > LEAK
        with enable_packing():
            assert gap() <= TOL


def test_absolute_positions_need_per_document_position_ids() -> None:
    model, batch = use_attention(_model("gpt2"), "sdpa"), packed_batch()
    assert logits_gap(model, batch, "sdpa") > LEAK
    with enable_packing(model=model):
        assert logits_gap(model, batch, "sdpa") <= TOL  # the collator's per-document positions
        with pytest.raises(ValueError, match="absolute position embeddings.*position_ids"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        with torch.no_grad():  # one document per row (0/1 mask) with row positions stays allowed
            model(input_ids=batch["input_ids"], attention_mask=(batch["attention_mask"] != 0).long())


@pytest.mark.parametrize(
    "family, reason",
    [
        ("inkling_text", "recurrent"),  # mixer mask through masking_utils: the builders refuse
        ("rwkv", "recurrent"),  # no masking_utils at all: the model forward refuses
        ("cpmant", "outside masking_utils"),  # its own masks: the model forward refuses
    ],
)
def test_refused_family_under_plain_enable_packing(family: str, reason: str) -> None:
    """No model= check: the forward itself refuses an indexed mask (int or float) and packed
    position_ids (which these families misread or ignore), naming the family and the reason; an
    ordinary padding mask still runs as in stock Transformers."""
    model, batch = use_attention(_model(family), "sdpa"), packed_batch()
    ids, positions = _flattened()
    name = family.removesuffix("_text")
    with enable_packing(), torch.no_grad():
        with pytest.raises(ValueError, match=rf"(?s){name}.*{reason}"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        with pytest.raises(ValueError, match=rf"(?s){name}.*{reason}"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].float())
        with pytest.raises(ValueError, match=reason):
            model(input_ids=ids, position_ids=positions)
        with pytest.raises(ValueError, match=reason):  # packed positions under an all-ones mask
            model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids))
        padding = (batch["attention_mask"] != 0).long()
        stock_free = model(input_ids=batch["input_ids"], attention_mask=padding).logits
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])  # row positions: fine
    stock = model(input_ids=batch["input_ids"], attention_mask=padding).logits
    torch.testing.assert_close(stock_free, stock)
    with pytest.raises(ValueError, match=reason):
        enable_packing(model=model)


def test_a_stateful_family_missing_from_the_registry_is_still_refused(monkeypatch) -> None:
    """Take qwen3_next out of the capability records (refused and made-correct lists): model= finds its mixer by structure, and
    under plain enable_packing() the recurrent-mask guard refuses what the builder let through."""
    import dataclasses

    import model_patches.packing.coverage as capabilities
    import model_patches.packing.mask_builders as patches

    model, batch = use_attention(_model("qwen3_next"), "sdpa"), packed_batch()
    emptied = tuple(dataclasses.replace(c, families=(), made_correct=()) for c in capabilities.CAPABILITIES)
    monkeypatch.setattr(capabilities, "CAPABILITIES", emptied)
    monkeypatch.setattr(patches, "capabilities_for_config", lambda config: [])
    with pytest.raises(ValueError, match=r"stateful_mixer \(module '.*linear_attn'\)"):
        enable_packing(model=model)
    with enable_packing(), torch.no_grad():
        with pytest.raises(ValueError, match="stateful_mixer"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
