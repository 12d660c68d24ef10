"""Generation with the packing patch on gives stock Transformers' results, bit for bit: the same
tokens and the same scores (``output_scores``, every step compared with ``torch.equal``), for
every cache implementation that runs on CPU, padded or not, with int, bool and float masks (or
none), greedy, beam search and sampling; and for every family of the packing oracle's sweep
(``model_patches.testing.packing_oracle.FAMILIES_UNDER_TEST``: dense, sliding-window, hybrid and
MoE; the other MoE families patched by name nightly), on eager and sdpa, dynamic and static
caches, compiled, and on flash_attention_2 through the CPU double. The sweep's models keep a
random embedding for the pad token, so padding rows carry real values.

Scores, not only tokens: a batch without documents must reach attention with stock's own mask,
padding rows included. An MoE block runs each expert once over the tokens routed to it, so a
padding row that attends differently from stock routes differently, changes the row count of the
experts' matmuls and moves real tokens' logits by a few ulps, which greedy tokens rarely show.
``test_an_ordinary_mask_reaches_attention_as_stock`` pins that mask itself.

A static cache's masks are as long as the cache, longer than the 2D mask; the document ids are
padded to the cache's capacity, read through the name the installed release gives it (a patch
record checks that name exists). Offloaded caches need CUDA and run in the CUDA-marked test.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import model_patches
from model_patches.packing.mask_builders import CACHE_CAPACITY, cache_capacity_probe
from model_patches.testing import tiny_causal_lm
from model_patches.testing.packing_oracle import FAMILIES_UNDER_TEST, backend, tiny_model

CPU_CACHES = ("dynamic", "static", "sliding_window", "hybrid")
MASKS = ("int64", "bool", "float32", "none")
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=2),
    "sample": dict(do_sample=True, top_k=20),
}
#: MoE families patched by name besides the sweep's Qwen3-MoE (tiny: 4 experts, top 2)
MORE_MOE: dict[str, dict[str, Any]] = {
    "mixtral": {},
    "qwen2_moe": {"mlp_only_layers": []},
}
#: the sweep's families (full attention, sliding windows, a sliding/full hybrid, MoE) and MORE_MOE
FAMILIES = (*FAMILIES_UNDER_TEST, *MORE_MOE)
#: the same, MORE_MOE marked slow (nightly) where a test generates with every family
FAMILY_PARAMS = [*FAMILIES_UNDER_TEST, *(pytest.param(f, marks=pytest.mark.slow) for f in MORE_MOE)]
#: (mask dtype, padding side) of the family tests: padded on either side and not, int and whole-number float
FAMILY_MASKS = (("int64", None), ("int64", "left"), ("int64", "right"), ("float32", "left"))


def _model(family: str, implementation: str) -> torch.nn.Module:
    if family in MORE_MOE:
        # pad_token_id=None: the pad token's embedding is not zeroed, so padding rows carry real values
        model = tiny_causal_lm(family, implementation, pad_token_id=None, **MORE_MOE[family])
    else:
        model = tiny_model(family, implementation=implementation)
    model.generation_config.pad_token_id = 0
    return model


def _inputs(mask_dtype: str, padding: str | None) -> dict[str, torch.Tensor]:
    """Two prompts of 7 tokens, the first one padded on the ``padding`` side (None: no padding).
    Right padding is what Transformers warns about but runs: generate() extends the mask with 1s
    after the pads (``1, 1, 1, 1, 0, 0, 0, 1, ...``), an ordinary padding mask all the same."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 120, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    if padding is not None:
        pads = slice(0, 3) if padding == "left" else slice(4, 7)
        mask[0, pads] = 0
        ids[0, pads] = 0
    if mask_dtype == "none":
        return {"input_ids": ids}
    return {"input_ids": ids, "attention_mask": mask.to(getattr(torch, mask_dtype))}


def _generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: str, decoding: str) -> Any:
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformers' notes about deprecated cache names
        return model.generate(
            **inputs, max_new_tokens=5, cache_implementation=cache, output_scores=True,
            return_dict_in_generate=True, **DECODING[decoding],
        )


def _assert_same_generation(stock: Any, patched: Any) -> None:
    """The same tokens and every step's scores bitwise (``torch.equal``)."""
    assert torch.equal(stock.sequences, patched.sequences), (stock.sequences, patched.sequences)
    assert len(stock.scores) == len(patched.scores)
    unequal = [(step, int((a != b).sum()), float((a - b).nan_to_num().abs().max()))
               for step, (a, b) in enumerate(zip(stock.scores, patched.scores)) if not torch.equal(a, b)]
    assert not unequal, f"scores differ from stock at (step, elements, max |diff|): {unequal}"


def _equal_with_patch(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: str, decoding: str) -> None:
    stock = _generate(model, inputs, cache, decoding)
    with model_patches.enable_packing():
        patched = _generate(model, inputs, cache, decoding)
    _assert_same_generation(stock, patched)


@pytest.mark.parametrize("cache", CPU_CACHES)
@pytest.mark.parametrize("mask_dtype", MASKS)
@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_every_cache_mask_dtype_and_decoding_matches_stock(cache: str, mask_dtype: str, decoding: str) -> None:
    model = _model("llama", "sdpa")
    _equal_with_patch(model, _inputs(mask_dtype, "left" if mask_dtype != "none" else None), cache, decoding)


@pytest.mark.parametrize("cache", CPU_CACHES)
@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_right_padding_matches_stock(cache: str, decoding: str) -> None:
    """A right-padded prompt: the 1s generate() appends after the pads continue the prompt's
    document (a 0/1 mask is a padding mask), so tokens and scores are stock's."""
    model = _model("llama", "sdpa")
    for mask_dtype in ("int64", "float32"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Transformers: "right-padding was detected"
            _equal_with_patch(model, _inputs(mask_dtype, "right"), cache, decoding)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_families_and_backends_match_stock(family: str, implementation: str, cache: str) -> None:
    """Tokens and scores bitwise, int64 and float masks, padded or not."""
    model = _model(family, implementation)
    for mask_dtype, padding in FAMILY_MASKS:
        _equal_with_patch(model, _inputs(mask_dtype, padding), cache, "greedy")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_flash_generation_matches_stock(family: str, cache: str) -> None:
    """flash_attention_2 (on CPU through the test double, Transformers' real flash path): a 0/1
    mask takes stock's path, so padded decoding works and is bitwise stock's."""
    model = _model(family, "eager")
    with backend(model, "flash_attention_2"):
        for mask_dtype, padding in FAMILY_MASKS:
            _equal_with_patch(model, _inputs(mask_dtype, padding), cache, "greedy")


_LEFT = [[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
#: ordinary 0/1 masks (left and right padding, pads inside a row, none, a padding row), int64 or float32
ORDINARY_MASKS = {
    "left, int64": torch.tensor(_LEFT),
    "left, float32": torch.tensor(_LEFT, dtype=torch.float32),
    "right, int64": torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]),
    # a right-padded prompt after generate() appended two tokens: one document with pads inside
    "right then generated, int64": torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]]),
    "right then generated, float32": torch.tensor([[1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.float32),
    "unpadded, float32": torch.ones(2, 7),
    "padding row, int64": torch.tensor([[0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1]]),
}


def _attention_masks(model: torch.nn.Module, **inputs: Any) -> tuple[torch.Tensor, list[Any]]:
    """(logits, the ``attention_mask`` each attention layer received) of one forward."""
    seen: list[Any] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        seen.append(kwargs.get("attention_mask"))

    hooks = [m.register_forward_hook(record, with_kwargs=True)
             for name, m in model.named_modules() if name.endswith("self_attn")]
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert seen, "no attention layer found"
    return logits, seen


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_an_ordinary_mask_reaches_attention_as_stock(family: str, implementation: str) -> None:
    """A batch without documents reaches every attention layer with stock's mask: the same
    tensor (dtype, shape, strides, values; padding rows included) or, where stock skips it for
    sdpa's ``is_causal``, none; and the logits are bitwise stock's."""
    model = _model(family, implementation)
    ids = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(5))
    for layout, mask in ORDINARY_MASKS.items():
        for use_cache in (False, True):
            inputs = dict(input_ids=ids, attention_mask=mask, use_cache=use_cache)
            stock_logits, stock = _attention_masks(model, **inputs)
            with model_patches.enable_packing():
                logits, patched = _attention_masks(model, **inputs)
            where = f"{layout}, use_cache={use_cache}"
            for layer, (a, b) in enumerate(zip(stock, patched)):
                if a is None or b is None:
                    assert a is None and b is None, f"{where}, layer {layer}: stock {a}, patched {b}"
                    continue
                assert (b.dtype, b.shape, b.stride()) == (a.dtype, a.shape, a.stride()), (where, layer)
                differ = (a != b).nonzero().tolist()
                assert not differ, f"{where}, layer {layer}: differs from stock at (b, h, q, kv) {differ[:6]}"
            assert torch.equal(stock_logits, logits), where


@pytest.mark.parametrize("family, implementation", [("llama", "sdpa"), ("qwen3_moe", "eager")])
def test_compiled_static_cache_generation_matches_stock(family: str, implementation: str) -> None:
    """Static-cache decoding compiled (``aot_eager``: what the patch changes is the graph, not the
    kernels). While tracing, the patch reads no mask values and builds the mask from document
    ids, which must still be stock's. Both runs compile: compiling alone moves the decode steps'
    last bits away from eager decoding, patch or not."""
    model = _model(family, implementation)
    model.generation_config.compile_config = None
    inputs = _inputs("int64", "left")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=False)
    try:
        stock = _generate(model, inputs, "static", "greedy")
        with model_patches.enable_packing():
            patched = _generate(model, inputs, "static", "greedy")
    finally:
        del model.forward
        torch._dynamo.reset()
    _assert_same_generation(stock, patched)


def test_the_cache_capacity_is_read_through_a_probed_name() -> None:
    from transformers.cache_utils import Cache

    assert cache_capacity_probe(Cache) is None
    rows = [r for r in model_patches.packing_status() if r.target == "transformers.cache_utils:Cache"]
    assert [r.state for r in rows] in (["available"], ["applied"])

    class NoCapacity:
        pass

    assert str(list(CACHE_CAPACITY)) in cache_capacity_probe(NoCapacity)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_offloaded_caches_match_stock_on_cuda(cache: str) -> None:
    model = _model("llama", "sdpa").cuda()
    inputs = {k: v.cuda() for k, v in _inputs("int64", "left").items()}
    _equal_with_patch(model, inputs, cache, "greedy")
