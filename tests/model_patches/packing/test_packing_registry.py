"""The packing records on the installed Transformers: completeness, undo, fail-closed refusals."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import transformers
import transformers.masking_utils as mu
import transformers.modeling_flash_attention_utils as fu

from model_patches import PatchError, enable_packing, packing_status
from model_patches.packing import check_model
from model_patches.packing.table import COVERED_FAMILIES, EPOCHS, packing_records
from model_patches.registry import apply_records
from model_patches.testing import tiny_causal_lm, use_attention
from model_patches.testing.packing_oracle import packed_batch, tiny_model

INDEXED = torch.tensor([[1, 1, 2, 2, 2, 0]])


def _originals() -> dict[str, object]:
    import transformers.models.llama.modeling_llama as ml

    return {
        "mu.create_causal_mask": mu.create_causal_mask,
        "mu.create_sliding_window_causal_mask": mu.create_sliding_window_causal_mask,
        "mu._preprocess_mask_arguments": mu._preprocess_mask_arguments,
        "fu._get_unpad_data": fu._get_unpad_data,
        "llama.create_causal_mask": ml.create_causal_mask,
    }


def test_every_record_fits_or_is_gated_out_on_the_installed_release() -> None:
    rows = packing_status()
    assert rows and not [r for r in rows if r.state == "failed"], [r for r in rows if r.state == "failed"]
    installed = transformers.__version__
    admitted = {e for e, (spec, _, _) in EPOCHS.items() if records_admit(spec, installed)}
    assert len(admitted) == 1, f"exactly one epoch must admit {installed}, got {admitted}"
    for r in rows:
        if r.epoch in EPOCHS and r.epoch not in admitted:
            assert r.state == "skipped" and installed in r.reason
    targets = {r.target for r in rows if r.state == "available"}
    for fam in ("llama", "qwen3", "mistral", "gemma3", "qwen3_moe"):
        assert f"transformers.models.{fam}.modeling_{fam}:create_causal_mask" in targets


def records_admit(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def test_enable_twice_is_noop_and_last_remove_restores_originals() -> None:
    before = _originals()
    h1 = enable_packing()
    patched = _originals()
    assert all(patched[k] is not before[k] for k in before)
    h2 = enable_packing()
    assert _originals() == patched  # not wrapped twice
    h1.remove()
    assert _originals() == patched  # h2 still holds them
    assert {r.state for r in packing_status() if r.target.endswith(":_get_unpad_data")} == {"applied"}
    h2.remove()
    assert _originals() == before
    with enable_packing() as h3:
        assert h3.active
    assert _originals() == before


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_padding_masks_of_every_dtype_mean_what_they_mean_in_stock(implementation: str) -> None:
    """A 0/1 mask (int, float, bf16) is read as one document per row plus padding: the real tokens'
    logits equal stock Transformers'; a bool mask passes through untouched (bitwise equal)."""
    model = use_attention(tiny_model("llama"), implementation)
    b = packed_batch()
    plain = b["attention_mask"] != 0
    plain[1, :2] = False  # left padding in one row as well
    with torch.no_grad():
        stock = model(input_ids=b["input_ids"], attention_mask=plain.long()).logits
        with enable_packing():
            for dtype in (torch.long, torch.int32, torch.float32, torch.bfloat16):
                patched = model(input_ids=b["input_ids"], attention_mask=plain.to(dtype)).logits
                gap = float((patched - stock)[plain].abs().max())
                assert gap <= 1e-5, f"{dtype}: real tokens differ from stock by {gap:.3g}"
            assert torch.equal(model(input_ids=b["input_ids"], attention_mask=plain).logits, stock)


def test_other_mask_builders_refuse_an_indexed_mask() -> None:
    config = tiny_model("llama").config
    embeds = torch.zeros(1, INDEXED.shape[1], 8)
    with enable_packing():
        # The guard checks the mask before anything else, so the remaining (per-release) arguments
        # are not needed to see it refuse.
        with pytest.raises(ValueError, match="do not cover"):
            mu._preprocess_mask_arguments(config, embeds, INDEXED)
        if hasattr(mu, "create_bidirectional_mask"):  # 5.x
            with pytest.raises(ValueError, match="do not cover"):
                mu.create_bidirectional_mask(config, embeds, INDEXED)
            mu.create_bidirectional_mask(config, embeds, (INDEXED != 0).long())  # a 0/1 mask is fine


def test_flash_decode_and_unknown_backends_are_refused() -> None:
    config = tiny_model("llama").config
    with enable_packing():
        config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="full sequences only"):
            mu.create_causal_mask(config, torch.zeros(1, 1, 8), INDEXED, None, position_ids=None)
        config._attn_implementation = "my_custom_kernel"
        with pytest.raises(ValueError, match="eager, sdpa, flex_attention"):
            mu.create_causal_mask(config, torch.zeros(1, 6, 8), INDEXED, None, position_ids=None)


def test_model_that_builds_masks_another_way_is_refused() -> None:
    model = tiny_causal_lm(
        "cpmant", None, sizes=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, dim_head=16,
            dim_ff=64, vocab_size=100, prompt_length=4, prompt_types=2, segment_types=2,
        ), family_sizes={}, train=True,
    )
    before = _originals()
    with pytest.raises(ValueError, match="cpmant.*leak across documents"):
        enable_packing(model=model)
    assert _originals() == before  # refused without leaving patches behind
    with enable_packing(model=tiny_model("gemma3")):
        check_model(tiny_model("qwen3_moe"))
    with pytest.raises(ValueError, match="llama"):
        check_model(tiny_model("llama"))  # packing is off again: nothing covers it


@pytest.fixture
def foreign_module(monkeypatch):
    """A model module whose create_causal_mask is its own function, not masking_utils'."""
    name = "transformers.models.fakefam.modeling_fakefam"
    mod = types.ModuleType(name)

    def create_causal_mask(config, inputs_embeds, attention_mask, cache, and_mask_function=None):
        return None

    mod.create_causal_mask = create_causal_mask
    monkeypatch.setitem(sys.modules, name, mod)
    return name


def test_module_with_its_own_mask_builder_fails_closed(foreign_module) -> None:
    before = _originals()
    with pytest.raises(PatchError, match=rf"(?s)transformers {transformers.__version__} is installed.*builds its masks another way"):
        enable_packing(extra_modules=[foreign_module])
    assert _originals() == before
    with enable_packing(strict=False, extra_modules=[foreign_module]) as h:
        states = {r.epoch: r.state for r in h.rows if "fakefam" in r.target}
        assert sorted(states.values()) == ["failed", "skipped", "skipped"], states  # the admitted epoch fails
        assert mu.create_causal_mask is not before["mu.create_causal_mask"]


def test_signature_drift_fails_closed() -> None:
    """Pretend the installed release were in the other epochs: their probes see the real signature."""
    installed = transformers.__version__
    for epoch, (spec, cache_arg, _) in EPOCHS.items():
        if records_admit(spec, installed):
            continue
        fake = spec.split(",")[0].lstrip(">=")
        fake = fake if fake.count(".") == 2 else fake + ".0"
        with pytest.raises(PatchError, match="probe of transformers.masking_utils:create_causal_mask failed"):
            apply_records(packing_records(), version=fake)
    with pytest.raises(PatchError, match="before masking_utils|4.53 or newer"):
        apply_records(packing_records(), version="4.51.3")


def test_newer_release_runs_probes_and_warns() -> None:
    """A release past the tested range is admitted by the open-ended epoch, warned about once,
    and still probed: on an older real install those probes see the old signature and refuse."""
    newest_epoch_fits = records_admit(EPOCHS["5.24+"][0], transformers.__version__)
    with pytest.warns(UserWarning, match="newer than the newest release"):
        if newest_epoch_fits:
            handle = apply_records(packing_records(), version="5.999.0")
            assert any(r.state == "applied" for r in handle.rows)
            handle.remove()
        else:
            with pytest.raises(PatchError, match="no 'cache' parameter"):
                apply_records(packing_records(), version="5.999.0")


def test_already_imported_modules_are_discovered() -> None:
    import transformers.models.arcee.modeling_arcee  # noqa: F401 - not in COVERED_FAMILIES

    assert "arcee" not in COVERED_FAMILIES
    assert any("modeling_arcee:create_causal_mask" in r.target for r in packing_status())


def _call_builder(fn, config, embeds: torch.Tensor, mask: torch.Tensor):
    """Call a create_*_mask builder of any supported release with no cache."""
    params = list(inspect.signature(getattr(fn, "_packing_original", fn)).parameters)
    kwargs = {"config": config, params[1]: embeds, "attention_mask": mask}
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(embeds.shape[1])
    return fn(**kwargs)


def test_late_import_falls_back_after_remove() -> None:
    """A module that grabbed the patched builder keeps working as stock once packing is off."""
    config = use_attention(tiny_model("llama"), "sdpa").config
    embeds = torch.zeros(1, 6, 8)
    with enable_packing():
        grabbed = mu.create_causal_mask
        packed = _call_builder(grabbed, config, embeds, INDEXED)
    stock = _call_builder(grabbed, config, embeds, INDEXED)
    original = _call_builder(mu.create_causal_mask, config, embeds, INDEXED)
    assert torch.equal(stock, original) and not torch.equal(packed, original)
    assert bool(packed[0, 0, 2, 1]) is False and bool(stock[0, 0, 2, 1]) is True  # doc 2 -> doc 1


def test_status_lists_every_live_record_however_it_was_applied() -> None:
    """Modules patched through model= (not in COVERED_FAMILIES), the MoE aux-loss records, one refused
    row per capability and one made-correct row for capabilities packing makes document-aware."""
    from model_patches.testing.family_sweep import tiny_causal_lm

    model = tiny_causal_lm("olmo")
    assert "olmo" not in COVERED_FAMILIES
    target = "transformers.models.olmo.modeling_olmo:create_causal_mask"
    aux = "transformers.models.mixtral.modeling_mixtral:load_balancing_loss_func"
    with enable_packing(model=model):
        rows = packing_status()
        applied = {r.target for r in rows if r.state == "applied"}  # one row per epoch; one admitted
        assert target in applied and aux in applied, sorted(applied)
        refused = [r for r in rows if r.state == "refused"]
        assert {"stateful_mixer", "own_masks"} <= {r.name.split()[1] for r in refused}
        assert any("rwkv" in r.target.split(", ") and "state carries" in r.reason for r in refused)
        made = {r.name.split()[1]: r for r in rows if r.name.endswith("(made correct)")}
        assert {"bloom", "falcon"} <= set(made["alibi"].target.split(", "))
        assert {"qwen3_next", "jamba", "bamba", "mamba"} <= set(made["stateful_mixer"].target.split(", "))
        assert not any("bloom" in r.target.split(", ") or "qwen3_next" in r.target.split(", ") for r in refused)
    tiny_causal_lm("bloom")  # imports modeling_bloom: its ALiBi record is live only under packing
    assert {r.state for r in packing_status() if r.name == "capability alibi (made correct)"} == {"available"}
    with enable_packing():
        assert {r.state for r in packing_status() if r.name == "capability alibi (made correct)"} == {"applied"}
    assert target not in {r.target for r in packing_status() if r.state == "applied"}
