"""The dtype each ``python -m bench`` section runs in: what the host computes fast unless a flag
says otherwise, stated with its reason in the printed header, report.md and report.json.

The capability is injected (``default_dtype(..., capability=...)``, or ``host_capability``
replaced), so both kinds of CPU are covered on whatever machine runs the tests.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from bench.__main__ import _available, build_parser, main, section_dtypes
from bench.harness import host_dtype
from bench.harness.isolated import reference
from bench.harness.measure import Measurement, run_spec
from bench.sections.lce import hf_models
from bench.sections.lce import section as ce_hidden

#: torch's ``get_cpu_capability()`` values and the bf16 ones host_capability adds.
NO_BF16_UNITS = ["AVX2", "AVX512", "NO AVX", "DEFAULT", "SVE256", "VSX", "Z VECTOR"]
BF16_UNITS = ["AVX512_BF16", "AMX_BF16"]
#: Section parts whose step multiplies matrices, and those that work on logits alone.
MATMUL_PARTS = {"lce", "logprobs", "dist hidden"}
LOGITS_PARTS = {"ce", "dist logits"}


def _args(argv: list[str]) -> argparse.Namespace:
    """The options ``python -m bench`` hands every section, as its parser builds them."""
    return build_parser(_available()).parse_args(argv)


@pytest.fixture
def capability(monkeypatch):
    """``set(cap)`` makes ``cap`` this host's CPU capability for the test."""
    def set_capability(cap: str) -> None:
        monkeypatch.setattr(host_dtype, "host_capability", lambda: cap)

    return set_capability


# --- the rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cap", NO_BF16_UNITS)
def test_cpus_without_bf16_matrix_units_default_to_fp32(cap):
    choice = host_dtype.default_dtype("cpu", cap)
    assert choice.dtype == "fp32"
    assert f"({cap}) has no bf16 matrix units" in choice.reason and "100x" in choice.reason
    assert str(choice).startswith("fp32: this CPU")


@pytest.mark.parametrize("cap", BF16_UNITS + ["avx512_bf16"])
def test_cpus_with_bf16_matrix_units_default_to_bf16(cap):
    choice = host_dtype.default_dtype("cpu", cap)
    assert choice == host_dtype.DtypeChoice("bf16", f"this CPU ({cap.upper()}) has bf16 matrix units")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("cap", ["AVX2", "AMX_BF16"])
def test_cuda_defaults_to_bf16_whatever_the_cpu(device, cap):
    for matmuls in (True, False):
        choice = host_dtype.default_dtype(device, cap, matmuls=matmuls)
        assert choice.dtype == "bf16" and "tensor cores" in choice.reason


@pytest.mark.parametrize("cap", NO_BF16_UNITS + BF16_UNITS)
def test_a_section_without_matmuls_keeps_bf16_on_every_cpu(cap):
    choice = host_dtype.default_dtype("cpu", cap, matmuls=False)
    assert choice.dtype == "bf16" and "has no matmuls" in choice.reason and cap in choice.reason


def test_default_dtype_refuses_a_device_that_is_not_a_string():
    import torch

    with pytest.raises(TypeError, match="device must be a device string"):
        host_dtype.default_dtype(torch.device("cpu"))


@pytest.mark.parametrize(("flags", "torch_flags", "torch_cap", "expected"), [
    ({"avx2", "fma"}, set(), "AVX2", "AVX2"),
    ({"avx2", "avx512f"}, set(), "AVX512", "AVX512"),
    ({"avx2", "avx512f", "avx512_bf16"}, set(), "AVX512", "AVX512_BF16"),
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, set(), "AVX512", "AMX_BF16"),
    (set(), {"avx512_bf16"}, "AVX512", "AVX512_BF16"),  # no /proc/cpuinfo: torch's own probe
])
def test_host_capability_names_the_bf16_matrix_units_torch_leaves_out(monkeypatch, flags, torch_flags, torch_cap,
                                                                      expected):
    # torch.backends.cpu.get_cpu_capability() says "AVX512" for a CPU with AVX512_BF16 too
    monkeypatch.setattr(host_dtype, "_cpuinfo_flags", lambda: frozenset(flags))
    monkeypatch.setattr(host_dtype, "_torch_flags", lambda: frozenset(torch_flags))
    monkeypatch.setattr(host_dtype.torch.backends.cpu, "get_cpu_capability", lambda: torch_cap)
    host_dtype.host_capability.cache_clear()
    try:
        assert host_dtype.host_capability() == expected
    finally:
        host_dtype.host_capability.cache_clear()


# --- flags --------------------------------------------------------------------------------------

def test_an_explicit_flag_wins_the_sections_own_before_dtype(capability):
    capability("AVX2")
    assert section_dtypes(_available(), _args(["--lce-dtype", "bf16"]))["lce"] == \
        host_dtype.DtypeChoice("bf16", "chosen with --lce-dtype")
    chosen = section_dtypes(_available(), _args(["--dtype", "bf16", "--logprobs-dtype", "fp16"]))
    assert chosen["logprobs"] == host_dtype.DtypeChoice("fp16", "chosen with --logprobs-dtype")
    for part in set(chosen) - {"logprobs"}:
        assert chosen[part] == host_dtype.DtypeChoice("bf16", "chosen with --dtype"), part
    capability("AMX_BF16")
    chosen = section_dtypes(_available(), _args(["--dtype", "fp32"]))
    assert {c.dtype for c in chosen.values()} == {"fp32"}


def test_the_fp32_reason_says_how_to_force_bf16(capability):
    capability("AVX2")
    reason = section_dtypes(_available(), _args([]))["lce"].reason
    assert reason.endswith("--lce-dtype bf16 (or --dtype bf16) to force"), reason


def test_choose_refuses_an_unknown_dtype_name():
    with pytest.raises(ValueError, match=r"--ce-dtype must be one of bf16, fp16, fp32, got 'fp8'"):
        host_dtype.choose(argparse.Namespace(ce_dtype="fp8", device="cpu"), "--ce-dtype")


def test_every_dtype_flag_leaves_the_default_to_the_host():
    """A dtype flag with a fixed default would pick bf16 on a CPU where bf16 matmuls crawl: every
    ``--*-dtype`` defaults to None and its section resolves it through ``dtypes(args)``."""
    mods = _available()
    parser = build_parser(mods)
    dtype_flags = {a.option_strings[0]: a for a in parser._actions if a.dest.endswith("dtype")}
    assert {"--dtype", "--ce-dtype", "--lce-dtype", "--logprobs-dtype"} <= set(dtype_flags)
    for flag, action in dtype_flags.items():
        assert action.default is None, f"{flag} defaults to {action.default!r}, not to the host's choice"
    for name, mod in mods.items():
        flags = [a.option_strings[0] for g in parser._action_groups if g.title == f"section {name}"
                 for a in g._group_actions if a.dest.endswith("dtype")]
        if flags:
            assert hasattr(mod, "dtypes"), f"section {name} has {flags} but no dtypes(args)"
        for flag in flags:
            chosen = mod.dtypes(_args([flag, "fp16"])).values()
            assert any(c == host_dtype.DtypeChoice("fp16", f"chosen with {flag}") for c in chosen), (flag, chosen)
    assert set(section_dtypes(mods, _args([]))) >= MATMUL_PARTS | LOGITS_PARTS


# --- the default run, per kind of CPU -----------------------------------------------------------

@pytest.mark.parametrize("cap", NO_BF16_UNITS)
def test_default_run_on_a_cpu_without_bf16_units_runs_no_bf16_matmul(capability, cap):
    capability(cap)
    chosen = section_dtypes(_available(), _args([]))
    for part in MATMUL_PARTS:
        assert chosen[part].dtype == "fp32", (part, chosen[part])
    for part in LOGITS_PARTS:
        assert chosen[part].dtype == "bf16", (part, chosen[part])
    assert chosen["trl"].dtype == "fp32"


@pytest.mark.parametrize("cap", BF16_UNITS)
def test_default_run_on_a_cpu_with_bf16_units_runs_bf16(capability, cap):
    capability(cap)
    chosen = section_dtypes(_available(), _args([]))
    for part in MATMUL_PARTS | LOGITS_PARTS:
        assert chosen[part].dtype == "bf16", (part, chosen[part])


def test_default_run_on_cuda_runs_bf16(capability):
    capability("AVX2")
    chosen = section_dtypes(_available(), _args(["--device", "cuda"]))
    for part in MATMUL_PARTS | LOGITS_PARTS:
        assert chosen[part].dtype == "bf16", (part, chosen[part])


# --- a section runs in the chosen dtype, and the report says so ----------------------------------

class _Recorder:
    """``measure`` in this process: the eager baseline really runs (its setup builds its inputs
    from the ``dtype`` it is handed); every call's setup and keywords are kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def __call__(self, setup: Any, kwargs: dict[str, Any], *, device: str = "cpu", repeats: int = 1,
                 **_: Any) -> Measurement:
        self.calls.append((setup, dict(kwargs)))
        if setup is ce_hidden.setup_eager and not kwargs.get("compiled"):
            return run_spec({"setup": reference(setup), "kwargs": kwargs, "device": device, "warmup": 1, "repeats": 1})
        return Measurement(seconds=1e-3, peak_extra_bytes=0)


@pytest.mark.parametrize(("cap", "extra", "dtype", "reason"), [
    ("AVX2", [], "fp32", "this CPU (AVX2) has no bf16 matrix units"),
    ("AMX_BF16", [], "bf16", "this CPU (AMX_BF16) has bf16 matrix units"),
    ("AVX2", ["--dtype", "bf16"], "bf16", "chosen with --dtype"),
    ("AMX_BF16", ["--lce-dtype", "fp32"], "fp32", "chosen with --lce-dtype"),
])
def test_a_section_runs_in_the_chosen_dtype_and_the_report_says_why(monkeypatch, tmp_path, capsys, capability, cap,
                                                                      extra, dtype, reason):
    capability(cap)
    recorder = _Recorder()
    monkeypatch.setattr(ce_hidden, "measure", recorder)
    monkeypatch.setattr(hf_models, "measure", recorder)
    out = tmp_path / "run"
    argv = ["--only", "lce", "--device", "cpu", "--lce-shape", "64,32,512", "--lce-repeats", "1", "--lce-hf",
            "1,16,512", "--lce-variants", ce_hidden.BASELINE, "--no-progress", "--out", str(out), *extra]
    assert main(argv) == 0

    # the section handed every variant, its Hugging Face table too, the chosen dtype
    assert recorder.calls and {kwargs["dtype"] for _, kwargs in recorder.calls} == {dtype}
    assert {setup for setup, _ in recorder.calls} >= {ce_hidden.setup_eager, hf_models.setup_hf}
    header = capsys.readouterr().out
    assert f"dtype lce: {dtype} - {reason}" in header
    assert f"cpu capability: {cap}" in header

    payload = json.loads((out / "report.json").read_text())
    assert payload["facts"]["dtypes"]["lce"]["dtype"] == dtype
    assert payload["facts"]["dtypes"]["lce"]["reason"].startswith(reason)
    section = payload["sections"]["lce"]
    assert section["data"]["dtype"] == dtype and section["data"]["dtype_choice"]["reason"].startswith(reason)
    first = section["tables"][0]
    assert f" {dtype} on cpu" in first["title"]
    assert any(note.startswith(f"dtype {dtype}: {reason}") for note in first["notes"]), first["notes"]
    assert f"--lce-dtype {dtype}" in first["command"]  # the reproduce command pins the dtype
    (baseline,) = [row for row in first["rows"] if row[0] == ce_hidden.BASELINE]
    assert baseline[-1] == "ok"
    hf = section["tables"][1]
    assert f"tiny Llama (H=64, 2 layers) {dtype}," in hf["title"] and f"--lce-dtype {dtype}" in hf["command"]

    md = (out / "report.md").read_text()
    assert f"- **dtype lce**: {dtype} - {reason}" in md
