"""The generic patch registry: gates, probes, fail-closed errors, reference-counted undo."""

from __future__ import annotations

import logging
import sys
import types
import warnings

import pytest

from model_patches.registry import (
    NEWEST_TESTED,
    PatchError,
    PatchRecord,
    apply_records,
    installed_version,
    record_status,
)


def _orig(x: int) -> int:
    return x + 1


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A throwaway module ``_fake_tf_target`` with a function and a nested attribute."""
    mod = types.ModuleType("_fake_tf_target")
    mod.func = _orig
    mod.Holder = type("Holder", (), {"method": staticmethod(_orig)})
    monkeypatch.setitem(sys.modules, "_fake_tf_target", mod)
    return mod


def _times_ten(original):
    def replacement(x: int) -> int:
        return original(x) * 10

    return replacement


def _ok_probe(original) -> None:
    return None if callable(original) else "not callable"


def rec(target="_fake_tf_target:func", versions=">=4.53", probe=_ok_probe, name="r") -> PatchRecord:
    return PatchRecord(name=name, target=target, versions=versions, probe=probe, build=_times_ten)


def test_record_validates_target_and_specifier() -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        rec(target="no_colon_here")
    with pytest.raises(ValueError, match="specifier"):
        rec(versions="about five")
    with pytest.raises(TypeError, match="callables"):
        PatchRecord("r", "m:a", ">=1", probe=None, build=_times_ten)  # type: ignore[arg-type]


def test_apply_and_remove_restores_exact_original(fake_module) -> None:
    handle = apply_records([rec()], version="5.0.0")
    assert fake_module.func(1) == 20
    assert [r.state for r in handle.rows] == ["applied"]
    handle.remove()
    assert fake_module.func is _orig
    handle.remove()  # second remove is a no-op
    assert fake_module.func is _orig


def test_nested_attribute_target(fake_module) -> None:
    with apply_records([rec(target="_fake_tf_target:Holder.method")], version="5.0.0"):
        assert fake_module.Holder.method(2) == 30
    assert fake_module.Holder.method(2) == 3


def test_refcount_applying_twice_is_noop_and_last_handle_restores(fake_module) -> None:
    r = rec()
    h1 = apply_records([r], version="5.0.0")
    h2 = apply_records([r], version="5.0.0")
    assert fake_module.func(1) == 20  # not wrapped twice (would be 200)
    h1.remove()
    assert fake_module.func(1) == 20  # h2 still holds it
    assert record_status([r], version="5.0.0")[0].state == "applied"
    h2.remove()
    assert fake_module.func is _orig
    assert record_status([r], version="5.0.0")[0].state == "available"


def test_gate_excludes_version_is_skipped(fake_module) -> None:
    with apply_records([rec(versions=">=4.53,<5.4")], version="5.24.0") as h:
        assert fake_module.func is _orig
        assert h.rows[0].state == "skipped"
        assert "5.24.0" in h.rows[0].reason and "<5.4" in h.rows[0].reason


def test_failed_probe_fails_closed_and_patches_nothing(fake_module) -> None:
    good = rec(name="good", target="_fake_tf_target:Holder.method")
    bad = rec(name="bad", probe=lambda o: "signature changed: no 'cache' argument")
    with pytest.raises(PatchError) as info:
        apply_records([good, bad], version="5.10.0")
    msg = str(info.value)
    assert "transformers 5.10.0 is installed" in msg
    assert "bad" in msg and "signature changed" in msg and ">=4.53" in msg and "strict=False" in msg
    assert fake_module.func is _orig and fake_module.Holder.method(2) == 3  # all or nothing


def test_missing_target_fails_closed(fake_module) -> None:
    with pytest.raises(PatchError, match="missing"):
        apply_records([rec(target="_fake_tf_target:gone")], version="5.0.0")
    with pytest.raises(PatchError, match="cannot be imported"):
        apply_records([rec(target="_no_such_module_xyz:f")], version="5.0.0")


def test_probe_that_raises_is_a_failed_probe(fake_module) -> None:
    def crash(o):
        raise KeyError("boom")

    row = record_status([rec(probe=crash)], version="5.0.0")[0]
    assert row.state == "failed" and "KeyError" in row.reason


def test_strict_false_logs_and_applies_the_rest(fake_module, caplog) -> None:
    good = rec(name="good", target="_fake_tf_target:Holder.method")
    bad = rec(name="bad", probe=lambda o: "different shape")
    with caplog.at_level(logging.WARNING, logger="model_patches.registry"):
        with apply_records([good, bad], strict=False, version="5.0.0") as h:
            assert fake_module.Holder.method(2) == 30
            assert fake_module.func is _orig
            assert [r.state for r in h.rows] == ["applied", "failed"]
    assert "different shape" in caplog.text
    rows = record_status([good, bad], version="5.0.0")
    assert [r.state for r in rows] == ["available", "failed"]


def test_newer_than_tested_runs_probes_and_warns_once(fake_module) -> None:
    newer = "77.1.0"
    with pytest.warns(UserWarning, match="newer than the newest release"):
        h = apply_records([rec()], version=newer)
    h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_records([rec()], version=newer).remove()  # second time: silent
    with pytest.raises(PatchError):  # the probe still runs on newer releases
        with pytest.warns(UserWarning):
            apply_records([rec(probe=lambda o: "nope")], version="78.0.0")


def test_probe_sees_the_original_while_patched(fake_module) -> None:
    seen = []

    def probe(o):
        seen.append(o)
        return None

    r = rec(probe=probe)
    with apply_records([r], version="5.0.0"):
        record_status([r], version="5.0.0")
        apply_records([r], version="5.0.0").remove()
    assert all(o is _orig for o in seen)


def test_two_records_on_one_target_conflict(fake_module) -> None:
    with apply_records([rec(name="one")], version="5.0.0"):
        with pytest.raises(PatchError, match="already patched"):
            apply_records([rec(name="two")], version="5.0.0")
    assert fake_module.func is _orig


def test_installed_version_is_the_imported_one() -> None:
    import transformers

    assert installed_version() == transformers.__version__
    assert NEWEST_TESTED.count(".") == 2


def test_remove_unwraps_from_under_a_later_closure_wrapper_or_refuses(fake_module) -> None:
    handle = apply_records([rec()], version="5.0.0")
    ours = fake_module.func

    def later(x: int) -> int:  # another library wrapping the patched function
        return ours(x) + 1000

    fake_module.func = later
    assert fake_module.func(1) == 1020
    handle.remove()
    assert fake_module.func is later and fake_module.func(1) == 1002  # ours is out, theirs stays

    handle = apply_records([rec()], version="5.0.0")
    fake_module.func = types.SimpleNamespace(wrapped=fake_module.func)  # holds ours, not in a closure
    with pytest.raises(ValueError, match="cannot be unwrapped"):
        handle.remove()
    assert handle.active
    fake_module.func = fake_module.func.wrapped
    handle.remove()
    assert fake_module.func is later  # what was there before the second patch


def test_the_old_names_of_the_linear_form_warn_and_still_work() -> None:
    import model_patches

    for old, new in model_patches.DEPRECATED.items():
        with pytest.warns(DeprecationWarning, match=f"model_patches.{new}"):
            assert getattr(model_patches, old) is getattr(model_patches, new)
        assert old not in model_patches.__all__ and new in model_patches.__all__
    assert {"enable_linear_cross_entropy", "LinearCrossEntropyHandle"} <= set(dir(model_patches))
