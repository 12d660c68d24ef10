"""PackingCollator: every token lands once, documents stay whole, labels never cross documents.

These tests look at the layout alone (no model sees the batches), so they build it with
``require_packing=False``; the refusal itself is tested in ``test_collator_leak.py``.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_patches import PackingCollator as _PackingCollator
from model_patches.packing.collator import first_fit_decreasing

PackingCollator = functools.partial(_PackingCollator, require_packing=False)

docs_strategy = st.lists(st.lists(st.integers(1, 999), min_size=1, max_size=20), min_size=1, max_size=25)


def _unpack(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int], list[int]]]:
    """(ids, labels, positions) of every document, read back from the rows."""
    out = []
    mask = batch["attention_mask"]
    for r in range(mask.shape[0]):
        row = mask[r].tolist()
        nums = [n for n in row if n]
        assert row == nums + [0] * (len(row) - len(nums)), "padding only at the end of a row"
        assert nums == sorted(nums) and set(nums) == set(range(1, max(nums, default=0) + 1))
        for n in sorted(set(nums)):
            sel = mask[r] == n
            out.append(tuple(batch[k][r][sel].tolist() for k in ("input_ids", "labels", "position_ids")))
        pad = mask[r] == 0
        assert (batch["labels"][r][pad] == -100).all() and (batch["position_ids"][r][pad] == 0).all()
    return out


@given(docs_strategy, st.integers(20, 48))
def test_every_document_lands_whole_once(docs, max_length) -> None:
    batch = PackingCollator(max_length, pad_token_id=0, return_num_tokens=True)(docs)
    rows = batch["input_ids"].shape[0]
    assert all(batch[k].shape == (rows, max_length) for k in ("input_ids", "labels", "attention_mask", "position_ids"))
    assert batch["num_tokens"].shape == (rows,) and batch["num_tokens"].dtype == torch.long
    assert batch["num_tokens"].tolist() == [int((batch["input_ids"][r] != 0).sum()) for r in range(rows)]
    assert int(batch["num_tokens"].sum()) == sum(map(len, docs)), "num_tokens counts every real token once"
    got = _unpack(batch)
    assert sorted(ids for ids, _, _ in got) == sorted(docs)
    for ids, labels, positions in got:
        assert positions == list(range(len(ids)))
        assert labels == [-100] + ids[1:], "first label of every document is -100, the rest are the ids"


@given(docs_strategy, st.integers(20, 48))
def test_rows_cannot_be_merged_first_fit_property(docs, max_length) -> None:
    batch = PackingCollator(max_length)(docs)
    used = (batch["attention_mask"] != 0).sum(-1).tolist()
    assert all(0 < u <= max_length for u in used)
    for i in range(len(used)):
        for j in range(i + 1, len(used)):
            assert used[i] + used[j] > max_length, "two rows that fit together mean a wasted row"


@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(30, 64))
def test_first_fit_decreasing_is_a_partition_within_capacity(lengths, cap) -> None:
    bins = first_fit_decreasing(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(a + b > cap for k, a in enumerate(loads) for b in loads[k + 1 :]), "first fit never leaves two mergeable bins"
    assert all(lengths[b[0]] >= lengths[i] for b in bins for i in b), "longest first within a bin"


def test_dict_examples_keep_their_labels() -> None:
    batch = PackingCollator(8)([{"input_ids": [5, 6, 7], "labels": [-100, 16, 17]}, {"input_ids": [8, 9]}])
    got = sorted(_unpack(batch))
    assert got == [([5, 6, 7], [-100, 16, 17], [0, 1, 2]), ([8, 9], [-100, 9], [0, 1])]


def test_overlong_truncate_split_error(caplog) -> None:
    long = list(range(1, 12))
    with caplog.at_level(logging.WARNING, logger="model_patches.packing.collator"):
        truncated = PackingCollator(4)([long])
    assert "truncated" in caplog.text
    assert [d[0] for d in _unpack(truncated)] == [[1, 2, 3, 4]]
    split = PackingCollator(4, overlong="split")([long])
    assert sorted(d[0] for d in _unpack(split)) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match="more than max_length=4"):
        PackingCollator(4, overlong="error")([long])


@pytest.mark.parametrize(
    "examples, err, match",
    [
        ([], ValueError, "no examples"),
        ([[], []], ValueError, "all empty"),
        (["text"], TypeError, "list of token ids"),
        ([{"labels": [1]}], ValueError, "without 'input_ids'"),
        ([{"input_ids": [1, 2], "labels": [1]}], ValueError, "labels has 1"),
    ],
)
def test_bad_input_is_rejected(examples, err, match) -> None:
    with pytest.raises(err, match=match):
        PackingCollator(8)(examples)


@pytest.mark.parametrize("kwargs, match", [({"max_length": 0}, "max_length"), ({"max_length": 4, "overlong": "drop"}, "overlong")])
def test_bad_settings_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        PackingCollator(**kwargs)


def test_efficiency_counts_real_tokens() -> None:
    batch = PackingCollator(10, return_num_tokens=True)([[1] * 6, [2] * 4, [3] * 5])
    assert _PackingCollator.efficiency(batch) == pytest.approx(15 / 20)
    assert batch["num_tokens"].tolist() == [10, 5]
    plain = PackingCollator(10)([[1] * 6, [2] * 4, [3] * 5])
    assert "num_tokens" not in plain and _PackingCollator.efficiency(plain) == pytest.approx(15 / 20)
