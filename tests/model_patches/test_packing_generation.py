"""Generation with the packing patch on gives stock Transformers' tokens, bit for bit, for every
cache implementation that runs on CPU, padded or not, with int, bool and float masks (or none),
greedy, beam search and sampling.

A static cache's masks are as long as the cache, longer than the 2D mask; the document ids are
padded to the cache's capacity, read through the name the installed release gives it (a patch
record checks that name exists). Offloaded caches need CUDA and run in the CUDA-marked test.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import model_patches
from model_patches.packing.mask_builders import CACHE_CAPACITY, cache_capacity_probe
from model_patches.testing import tiny_causal_lm

CPU_CACHES = ("dynamic", "static", "sliding_window", "hybrid")
MASKS = ("int64", "bool", "float32", "none")
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=2),
    "sample": dict(do_sample=True, top_k=20),
}
#: families with full attention, MoE, sliding-window layers and a soft-capped hybrid pattern
FAMILIES = {
    "llama": {},
    "qwen3_moe": {"mlp_only_layers": []},
    "mistral": {"sliding_window": 4},
    "gemma3_text": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
}


def _model(family: str, implementation: str) -> torch.nn.Module:
    model = tiny_causal_lm(family, implementation, **FAMILIES[family])
    model.generation_config.pad_token_id = 0
    return model


def _inputs(mask_dtype: str, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 120, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding, as generation wants it
        ids[0, :3] = 0
    if mask_dtype == "none":
        return {"input_ids": ids}
    return {"input_ids": ids, "attention_mask": mask.to(getattr(torch, mask_dtype))}


def _generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: str, decoding: str) -> torch.Tensor:
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformers' notes about deprecated cache names
        return model.generate(**inputs, max_new_tokens=5, cache_implementation=cache, **DECODING[decoding])


def _equal_with_patch(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: str, decoding: str) -> None:
    stock = _generate(model, inputs, cache, decoding)
    with model_patches.enable_packing():
        patched = _generate(model, inputs, cache, decoding)
    assert torch.equal(stock, patched), (stock, patched)


@pytest.mark.parametrize("cache", CPU_CACHES)
@pytest.mark.parametrize("mask_dtype", MASKS)
@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_every_cache_mask_dtype_and_decoding_matches_stock(cache: str, mask_dtype: str, decoding: str) -> None:
    model = _model("llama", "sdpa")
    _equal_with_patch(model, _inputs(mask_dtype, padded=mask_dtype != "none"), cache, decoding)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_families_and_backends_match_stock(family: str, implementation: str, cache: str) -> None:
    model = _model(family, implementation)
    for padded in (False, True):
        _equal_with_patch(model, _inputs("int64", padded), cache, "greedy")


def test_compiled_static_cache_generation_matches_stock() -> None:
    """Static-cache decoding compiled (``aot_eager``: what the patch changes is the graph, not the kernels)."""
    model = _model("llama", "sdpa")
    model.generation_config.compile_config = None
    inputs = _inputs("int64", padded=True)
    stock = _generate(model, inputs, "static", "greedy")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=False)
    model.forward = compiled
    try:
        with model_patches.enable_packing():
            patched = _generate(model, inputs, "static", "greedy")
    finally:
        del model.forward
        torch._dynamo.reset()
    assert torch.equal(stock, patched)


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
    inputs = {k: v.cuda() for k, v in _inputs("int64", padded=True).items()}
    _equal_with_patch(model, inputs, cache, "greedy")
