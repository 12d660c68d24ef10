"""No silent leak from PackingCollator batches: refused without the packing patches, correct with them.

Why the refusal: stock Transformers reads the collator's indexed mask as 0/1 on every backend
(the negative control below), so an unpatched model would mix documents without an error. The
collator cannot see the model; it checks the patch registry at call time, and a spawned
DataLoader worker uses the state of the process that sent it the collator.
"""

from __future__ import annotations

import functools
import multiprocessing

import pytest
import torch
from packaging.version import Version

import model_patches
from model_patches import PackingCollator, enable_packing
from model_patches.packing.enable import packing_enabled
from model_patches.registry import installed_version
from model_patches.testing.family_sweep import tiny_causal_lm
from model_patches.testing.packing_oracle import BACKENDS, backend, documents, logits_gap, packed_batch, tiny_model

TOL = 1e-4  # fp32, max |packed - per-document|
LEAK = 1e-2  # stock must be at least this far off
DOCS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22], [23, 24, 25, 26], [27, 28, 29]]


@functools.lru_cache(maxsize=None)
def _llama() -> torch.nn.Module:
    return tiny_model("llama").eval()


def test_refused_without_packing_and_the_message_names_the_fix() -> None:
    assert not packing_enabled()
    with pytest.raises(ValueError) as err:
        PackingCollator(12)(DOCS)
    message = str(err.value)
    for part in ("as 0/1", "attend to each other", "model_patches.enable_packing()", "require_packing=False"):
        assert part in message, message


def test_accepted_while_packing_is_on_and_refused_again_after_remove() -> None:
    collator = PackingCollator(12, return_num_tokens=True)
    with enable_packing():
        assert packing_enabled()
        batch = collator(DOCS)
    assert int(batch["num_tokens"].sum()) == sum(map(len, DOCS)) == int((batch["attention_mask"] != 0).sum())
    with pytest.raises(ValueError, match="not active in this process"):
        collator(DOCS)
    assert PackingCollator(12, require_packing=False)(DOCS)["input_ids"].equal(batch["input_ids"])


@pytest.mark.parametrize("implementation", BACKENDS)
def test_stock_leaks_on_every_backend_and_the_patched_batch_is_correct(implementation: str) -> None:
    """The negative control that makes the refusal necessary, and the whole default batch
    (``num_tokens`` included) through ``model(**batch)`` under the patches."""
    model = _llama()
    with enable_packing():
        batch = PackingCollator(12, return_num_tokens=True)(DOCS)
    layout = {k: v for k, v in batch.items() if k != "num_tokens"}
    stock = logits_gap(model, layout, implementation)
    assert stock > LEAK, f"stock Transformers kept the documents apart on {implementation} ({stock:.3g})"
    with enable_packing(), torch.no_grad(), backend(model, implementation):
        got = model(**batch, use_cache=False)
        plain = model(**layout, use_cache=False)
    assert torch.equal(got.logits, plain.logits) and torch.equal(got.loss, plain.loss)
    with enable_packing():
        assert logits_gap(model, layout, implementation) <= TOL


def test_padding_free_rows_are_not_kept_apart_by_stock_transformers_in_general() -> None:
    """Why the collator offers no unpatched padding-free layout: stock keeps one concatenated row
    (no mask, positions restarting) apart only without a KV cache, and only for families whose sole
    sequence mixer is masked attention."""
    batch = packed_batch()
    docs = documents(batch)
    row = {k: torch.cat([batch[k][r, s:e] for r, s, e in docs])[None] for k in ("input_ids", "position_ids")}

    def gap(model: torch.nn.Module, use_cache) -> float:
        with torch.no_grad():
            out = model(**row, use_cache=use_cache).logits[0]
            ref = torch.cat([model(**{k: v[:, s:e] for k, v in row.items()}, use_cache=False).logits[0]
                             for s, e in _spans(docs)])
        return float((out - ref).abs().max())

    llama = _llama()
    with backend(llama, "sdpa"):
        assert gap(llama, use_cache=False) <= TOL
        assert gap(llama, use_cache=None) > LEAK  # the config's use_cache=True: a cache turns detection off
    assert gap(tiny_causal_lm("qwen3_next", None), use_cache=False) > LEAK  # a recurrent state crosses documents


def _spans(docs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for _, s, e in docs:
        out.append((start, start + e - s))
        start += e - s
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom", "qwen3_next", "mamba"])
def test_num_tokens_is_ignored_by_the_model_and_the_loss(family: str) -> None:
    """``num_tokens`` reaches ``model(**batch)`` under Trainer. On Transformers 5.x the families
    with their own positions, ALiBi and per-document mixers take it in ``**kwargs`` and ignore it,
    and so does the hidden-state loss (which hands unknown keys to the decoder); some 4.x
    forwards (bloom on 4.57) refuse it loudly, which is why the key is opt-in."""
    try:
        model = tiny_causal_lm(family, None)
        handle = enable_packing(model=model)
    except (ImportError, ValueError) as exc:  # a family this release cannot build or pack
        pytest.skip(f"{family} on transformers {installed_version()}: {str(exc)[:120]}")
    with handle:
        batch = PackingCollator(12, return_num_tokens=True)(DOCS)
        layout = {k: v for k, v in batch.items() if k != "num_tokens"}
        with torch.no_grad():
            try:
                with_key = model(**batch, use_cache=False).loss
            except (TypeError, ValueError) as exc:
                assert Version(installed_version()) < Version("5") and "num_tokens" in str(exc), exc
                return
            assert torch.equal(with_key, model(**layout, use_cache=False).loss)
            if family == "llama":
                loss = model_patches.causal_lm_loss(model, **batch)
                assert torch.equal(loss, model_patches.causal_lm_loss(model, **layout))


def _batches(context: str, workers: int = 1) -> list[dict[str, torch.Tensor]]:
    loader = torch.utils.data.DataLoader(
        [DOCS[:3], DOCS[3:]], batch_size=None, num_workers=workers, collate_fn=PackingCollator(12, return_num_tokens=True),
        multiprocessing_context=multiprocessing.get_context(context) if workers else None,
    )
    return list(loader)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_see_the_parent_state(context: str) -> None:
    """fork workers inherit the patch state; spawn workers get it with the pickled collator."""
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {context} start method here")
    with pytest.raises(ValueError, match="not active"):
        _batches(context)
    with enable_packing():
        got = _batches(context)
    assert [int(b["num_tokens"].sum()) for b in got] == [18, 7]
