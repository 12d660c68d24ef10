"""Pure mask helpers against brute-force Python references (hypothesis draws the layouts)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_patches.packing.masks import (
    block_causal_mask_function,
    dense_block_causal_mask,
    document_ids,
    document_lengths,
    is_indexed_mask,
    reads_as_document_ids,
    same_document_mask_function,
    unpad_documents,
)
from model_patches.testing import sdpa_flash_attn_varlen_func


@st.composite
def layouts(draw) -> list[list[int]]:
    """Rows of equal length: documents as runs of an arbitrary positive id, zeros anywhere."""
    length = draw(st.integers(1, 14))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        row: list[int] = []
        while len(row) < length:
            value = draw(st.integers(0, 4))
            row += [value] * draw(st.integers(1, length - len(row)))
        rows.append(row)
    return rows


def _runs(row: list[int]) -> list[list[int]]:
    """The positions of every maximal run of one non-zero value among the row's real tokens
    (padding skipped: ``1, 0, 1`` is one document): the documents."""
    out: list[list[int]] = []
    previous = 0
    for i, value in enumerate(row):
        if not value:
            continue
        if value != previous:
            out.append([])
        out[-1].append(i)
        previous = value
    return out


@given(layouts())
def test_document_ids_number_runs_per_row(rows) -> None:
    ids = document_ids(torch.tensor(rows))
    for r, row in enumerate(rows):
        expect = [0] * len(row)
        for k, positions in enumerate(_runs(row), start=1):
            for i in positions:
                expect[i] = k
        assert ids[r].tolist() == expect


def test_padding_inside_a_row_does_not_end_its_document() -> None:
    """What generate() makes of a right-padded prompt: one document with pads inside, and packed
    position_ids still split documents whether they count the pads or not."""
    from model_patches.packing.masks import document_positions, split_at_position_resets

    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 2, 2, 0, 2, 1]])
    ids = document_ids(mask)
    assert ids.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 2, 2, 0, 2, 3]]
    assert document_positions(ids)[ids != 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 0]
    generate_positions = torch.tensor([[0, 1, 2, 1, 1, 3, 4]])  # attention_mask.cumsum(-1) - 1, pads filled
    for positions in (generate_positions, torch.arange(7)[None]):
        assert torch.equal(split_at_position_resets(ids[:1], positions), ids[:1])
    packed = torch.tensor([[0, 1, 2, 0, 0, 1, 2]])  # a restart after the pads: a new document
    assert split_at_position_resets(ids[:1], packed).tolist() == [[1, 1, 1, 0, 0, 2, 2]]
    assert document_lengths(mask).tolist() == [5, 2, 3, 1]


@given(layouts())
def test_unpad_documents_gives_one_sequence_per_document(rows) -> None:
    mask = torch.tensor(rows)
    indices, cu, max_len = unpad_documents(mask)
    docs = [[r * len(rows[0]) + i for i in positions] for r, row in enumerate(rows) for positions in _runs(row)]
    lengths = [len(d) for d in docs]
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + n)
    assert cu.dtype == torch.int32 and cu.tolist() == expected_cu
    assert indices.tolist() == [i for d in docs for i in d]
    assert max_len == max(lengths, default=0)
    assert document_lengths(mask).tolist() == lengths


@given(layouts(), st.sampled_from([torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.bool]))
def test_every_dtype_reads_as_the_same_documents(rows, dtype) -> None:
    """Float and bf16 masks of ids mean what the integer mask means; bool is one document per run."""
    mask = torch.tensor(rows)
    expect = document_ids(mask != 0) if dtype == torch.bool else document_ids(mask)
    assert torch.equal(document_ids(mask.to(dtype)), expect)
    assert reads_as_document_ids(mask.to(dtype)) == (dtype != torch.bool)


def test_document_ids_compile_without_graph_breaks() -> None:
    """No host sync in the id computation or its validation: one graph, and it still refuses."""
    mask = torch.tensor([[1, 1, 2, 0], [3, 3, 3, 3]])
    explained = torch._dynamo.explain(document_ids)(mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(document_ids, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(mask.float()), document_ids(mask))
    with pytest.raises(RuntimeError, match=">= 0"):
        compiled(torch.tensor([[1, -1, 2, 0], [1, 1, 1, 1]]))


@given(layouts(), st.one_of(st.none(), st.integers(1, 5)))
def test_block_causal_mask_matches_the_rule(rows, window) -> None:
    dense = dense_block_causal_mask(torch.tensor(rows), window)
    for r, row in enumerate(rows):
        doc = {i: k for k, positions in enumerate(_runs(row), start=1) for i in positions}
        for q in range(len(row)):
            for kv in range(len(row)):
                # a padding query sees what Transformers' padding mask gives it: every real key
                sees = kv in doc and (q not in doc or doc[q] == doc[kv])
                ok = kv <= q and sees and (window is None or q - kv < window)
                assert bool(dense[r, 0, q, kv]) == ok, (r, q, kv)
        real = torch.tensor([q in doc for q in range(len(row))], dtype=torch.bool)
        assert dense[r, 0, real].any(-1).all(), "every real query attends to something (itself)"
        if len(_runs(row)) <= 1:  # an ordinary padding row: exactly causal AND key not padding
            q, kv = torch.arange(len(row))[:, None], torch.arange(len(row))[None, :]
            stock = (kv <= q) & real[None, :] & ((q - kv < window) if window else True)
            assert torch.equal(dense[r, 0], stock), r


def test_mask_function_pads_to_a_longer_cache() -> None:
    ids = document_ids(torch.tensor([[1, 1, 2]]))
    fn = same_document_mask_function(ids, kv_length=5)
    b, h = torch.tensor(0), torch.tensor(0)
    assert bool(fn(b, h, torch.tensor(2), torch.tensor(4))) is False  # past the mask = padding
    assert bool(fn(b, h, torch.tensor(1), torch.tensor(0))) is True


def test_is_indexed_mask() -> None:
    assert is_indexed_mask(torch.tensor([[1, 1, 2, 0]]))
    assert not is_indexed_mask(torch.tensor([[1, 1, 1, 0]]))  # an ordinary padding mask
    assert not is_indexed_mask(torch.tensor([[True, False]]))
    assert is_indexed_mask(torch.tensor([[1.0, 2.0]]))  # a float mask of ids is indexed, not a padding mask
    assert is_indexed_mask(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16))
    assert not is_indexed_mask(torch.tensor([[1.0, 1.0, 0.0]]))
    assert not is_indexed_mask(torch.ones(1, 1, 2, 2, dtype=torch.long) * 2)  # 4D masks are not ours
    assert not is_indexed_mask(None)


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (torch.ones(1, 1, 4, dtype=torch.long), ValueError, "2D"),
        (torch.ones(1, 4, dtype=torch.complex64), TypeError, "integers"),
        (torch.tensor([[1, -1]]), ValueError, ">= 0"),
        (torch.tensor([[1.0, 1.5]]), ValueError, "whole number"),
        (torch.tensor([[1.0, -1.0]]), ValueError, "whole number"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, "whole number"),
        (torch.tensor([[1.0, 300.0]], dtype=torch.bfloat16), ValueError, r"\[0, 256\]"),
        ([[1, 2]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_masks_are_rejected(bad, err, match) -> None:
    with pytest.raises(err, match=match):
        document_ids(bad)
    with pytest.raises(ValueError, match="sliding_window"):
        block_causal_mask_function(torch.ones(1, 2, dtype=torch.long), 0)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.sampled_from([(-1, -1), (2, 2)]), st.integers(0, 2**16))
def test_varlen_double_equals_each_sequence_alone(lengths, window, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 4, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = sdpa_flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, window_size=window)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = e - s
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & ((i - j <= window[0]) if window[0] >= 0 else True)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / 8**0.5
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v[s:e])
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)
