"""Families packing used to refuse, now made correct: ALiBi from per-document positions, and
stateful mixers (gated delta nets, Mamba / Mamba-2, short convolutions) run per document.

Every check is against each document run alone (the oracle), and the control requires stock
Transformers to leak on the same batch, so each test can fail.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_patches import enable_packing
from model_patches.packing.alibi import build_alibi
from model_patches.packing.coverage import refusals_for_model
from model_patches.packing.document_mixers import document_ids_from_cu_seqlens, segment_layout
from model_patches.packing.masks import document_ids
from model_patches.testing.family_sweep import tiny_causal_lm
from model_patches.testing.packing_oracle import documents, grad_gap, logits_gap, packed_batch

TOL, LEAK = 1e-4, 1e-2
MIXERS = ("qwen3_next", "bamba", "jamba", "mamba")  # mamba: no attention, mask straight to its mixers
ALIBI = {"bloom": {}, "falcon": {"alibi": True}}


@functools.lru_cache(maxsize=None)
def _model(family: str) -> torch.nn.Module:
    overrides = ALIBI.get(family, {})
    drop = ("head_dim", "num_key_value_heads") if family == "falcon" else ()
    return tiny_causal_lm(family, None, seed=4, drop=drop, **overrides)


def _implementation(model: torch.nn.Module) -> str:
    return model.config._attn_implementation or "eager"


@pytest.mark.parametrize("family", [*MIXERS, *ALIBI])
def test_packed_training_step_equals_each_document_alone(family: str) -> None:
    """Logits with the cache left at its default (a fresh cache is built), and the gradients of
    every parameter, in train mode."""
    model, batch = _model(family), packed_batch()
    impl = _implementation(model)
    assert logits_gap(model, batch, impl) > LEAK  # stock leaks
    with enable_packing(model=model):
        assert logits_gap(model, batch, impl, use_cache=True) <= TOL
        model.train()
        try:
            gap, scale = grad_gap(model, batch, impl)
        finally:
            model.eval()
    assert gap <= TOL * max(scale, 1.0), (gap, scale)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_position_id_packing_reaches_the_mixers(family: str) -> None:
    """One flattened row with restarting position_ids and no mask (DataCollatorWithFlattening,
    TRL padding_free), with and without its flash kwargs (cu_seq_lens_q, which the mixers'
    torch paths cannot use): each document as alone."""
    from transformers import DataCollatorWithFlattening

    model, batch = _model(family), packed_batch()
    docs = [batch["input_ids"][r, s:e].tolist() for r, s, e in documents(batch)]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    inputs = {k: v for k, v in flat.items() if k != "labels"}
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])
        stock = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits[0]
        assert float((stock - alone).abs().max()) > LEAK
        with enable_packing(model=model):
            for kwargs in (inputs, {"input_ids": flat["input_ids"], "position_ids": flat["position_ids"]}):
                got = model(**kwargs).logits[0]
                assert float((got - alone).abs().max()) <= TOL


def test_position_id_packing_without_a_mask_is_refused_where_mixers_read_only_the_mask() -> None:
    """Mamba's mixers take the model's attention_mask and nothing else: packed position_ids
    without an indexed mask are refused (stock ignores them and leaks); the collator's indexed
    mask with its per-document positions is accepted, and row positions with a 0/1 mask too."""
    from transformers import DataCollatorWithFlattening

    model, batch = _model("mamba"), packed_batch()
    docs = [batch["input_ids"][r, s:e].tolist() for r, s, e in documents(batch)]
    flat = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    with enable_packing(model=model), torch.no_grad():
        with pytest.raises(ValueError, match="mamba.*indexed attention mask only"):
            model(input_ids=flat["input_ids"], position_ids=flat["position_ids"])
        with pytest.raises(ValueError, match="indexed attention mask only"):
            model(input_ids=flat["input_ids"], position_ids=flat["position_ids"],
                  attention_mask=torch.ones_like(flat["input_ids"]))
        length = flat["input_ids"].shape[1]
        model(input_ids=flat["input_ids"], position_ids=torch.arange(length)[None],
              attention_mask=torch.ones_like(flat["input_ids"]))
        assert logits_gap(model, batch, "eager") <= TOL


@pytest.mark.parametrize("family", MIXERS)
def test_padded_batches_and_generation_are_stock(family: str) -> None:
    """One document per row (left padding, a 0/1 int mask): the original mixer runs, as stock;
    and greedy generation gives stock's tokens."""
    model = _model(family)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits
        stock_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        with enable_packing(model=model):
            got = model(input_ids=ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(got[mask.bool()], stock[mask.bool()], atol=1e-5, rtol=0)
    assert torch.equal(tokens, stock_tokens)


@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
def test_a_cache_cannot_carry_packed_documents(family: str) -> None:
    """Decoding from a cache a packed forward filled raises (its mixer layers hold no state), and
    a packed row cannot continue a cache that holds state."""
    model, batch = _model(family), packed_batch()
    with enable_packing(model=model), torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=True)
        step = torch.cat([batch["attention_mask"], batch["attention_mask"][:, -1:]], 1)
        with pytest.raises(ValueError, match="filled by a packed forward"):
            model(input_ids=torch.ones(3, 1, dtype=torch.long), attention_mask=step, cache=out.cache)
        prefix = torch.randint(3, 100, (3, 4))
        warm = model(input_ids=prefix, use_cache=True).cache
        more = torch.cat([torch.ones(3, 4, dtype=torch.long), batch["attention_mask"]], 1)
        with pytest.raises(ValueError, match="cache that already holds state"):
            model(input_ids=batch["input_ids"], attention_mask=more, cache=warm)


def test_a_made_correct_family_whose_record_cannot_apply_is_refused(monkeypatch) -> None:
    """If a family's mixer record does not fit (here: a target that does not exist, applied with
    strict=False), the family is refused at forward time, never silently run unpatched."""
    import model_patches.packing.coverage as capabilities

    model, batch = _model("qwen3_next"), packed_batch()
    broken = []
    for cap in capabilities.CAPABILITIES:
        made = tuple(
            (f, (*t, "transformers.models.qwen3_next.modeling_qwen3_next:NoSuchMixer.forward") if f == "qwen3_next" else t)
            for f, t in cap.made_correct
        )
        broken.append(dataclasses.replace(cap, made_correct=made))
    monkeypatch.setattr(capabilities, "CAPABILITIES", tuple(broken))
    assert refusals_for_model(model, assume_patched=False)
    with enable_packing(strict=False), torch.no_grad():
        with pytest.raises(ValueError, match=r"(?s)qwen3_next.*stateful_mixer"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_alibi_of_an_indexed_mask_is_each_document_alone() -> None:
    """The bias of every document equals its family's bias for that document alone; 0/1 masks
    (left padding) keep stock's values and bool masks pass through."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as stock
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as stock_falcon

    mask = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    for original in (stock, stock_falcon):
        patched = build_alibi(original)
        got = patched(mask, 3, torch.float32).reshape(2, 3, 1, 8)
        for row, start, end in [(0, 0, 3), (0, 3, 5), (0, 5, 6), (1, 2, 8)]:
            alone = original(torch.ones(1, end - start, dtype=torch.long), 3, torch.float32)
            torch.testing.assert_close(got[row, :, 0, start:end], alone[:, 0, :], rtol=0, atol=0)
        assert float(got[0, :, 0, 6:].abs().max()) == 0  # padding
        padded = torch.tensor([[0, 0, 1, 1, 1]])
        torch.testing.assert_close(patched(padded, 2, torch.float32), original(padded, 2, torch.float32), rtol=0, atol=0)
        as_bool = padded.bool()
        torch.testing.assert_close(patched(as_bool, 2, torch.float32), original(as_bool, 2, torch.float32), rtol=0, atol=0)


def test_alibi_families_compile_whole() -> None:
    """Bloom under enable_packing: packed and padded batches trace with fullgraph=True, into one
    graph, and match the eager patched forward."""
    from torch._dynamo.testing import CompileCounter

    model, batch = _model("bloom"), packed_batch()
    padded = (batch["attention_mask"] != 0).long()
    torch._dynamo.reset()
    counter = CompileCounter()

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    compiled = torch.compile(forward, backend=counter, fullgraph=True)
    with enable_packing(model=model), torch.no_grad():
        for mask in (batch["attention_mask"], padded):
            got, want = compiled(batch["input_ids"], mask), forward(batch["input_ids"], mask)
            torch.testing.assert_close(got[mask != 0], want[mask != 0], atol=1e-5, rtol=0)
    assert counter.frame_count == 1


def test_mixers_run_under_compile() -> None:
    """A compiled packed forward of a mixer family (one graph break per mixer layer, where the
    layout is read) equals the eager patched forward."""
    model, batch = _model("qwen3_next"), packed_batch()
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"], use_cache=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with enable_packing(model=model), torch.no_grad():
        got, want = compiled(**kwargs).logits, model(**kwargs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=3).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_segment_layout_covers_every_token_once_within_twice_its_size(rows: list[list[int]]) -> None:
    ids = document_ids(torch.tensor(rows))
    layout = segment_layout(ids)
    flat = ids.flatten()
    seen = []
    for index, valid in layout.groups:
        assert bool((valid[:, :-1] >= valid[:, 1:]).all())  # each document is a prefix of its row
        for r in range(index.shape[0]):
            tokens = index[r][valid[r]]
            between = flat[int(tokens[0]):int(tokens[-1]) + 1]
            assert bool((between[between != 0] == flat[tokens[0]]).all())  # contiguous but for padding
            assert int((between != 0).sum()) == tokens.numel()
            doc = flat[tokens]
            assert bool((doc == doc[0]).all()) and int(doc[0]) != 0
            assert bool((index[r][~valid[r]] == flat.numel()).all())  # padding points at the zero slot
            seen += tokens.tolist()
    assert sorted(seen) == torch.nonzero(flat).flatten().tolist()
    assert layout.real_tokens == len(seen) and layout.padded_tokens < 2 * max(layout.real_tokens, 1)
    rows_with_docs = [int((ids[r].unique() != 0).sum()) for r in range(ids.shape[0])]
    assert layout.one_per_row == all(n <= 1 for n in rows_with_docs)


def test_document_ids_from_cu_seqlens() -> None:
    got = document_ids_from_cu_seqlens(torch.tensor([0, 3, 4, 7], dtype=torch.int32), 9)
    assert got.tolist() == [[1, 1, 1, 2, 3, 3, 3, 0, 0]]
