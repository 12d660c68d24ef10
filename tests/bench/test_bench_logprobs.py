"""The ``logprobs`` section of ``python -m bench`` at tiny shapes: its tables, formulas and plots."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.harness import measure as bench_measure
from bench.harness.isolated import reference
from bench.harness.report import Section
from bench.sections.logprobs import section as logprobs
from bench.sections.logprobs import steps as logprobs_steps

TINY = ["--logprobs-n", "64", "--logprobs-h", "32", "--logprobs-v", "512", "--logprobs-repeats", "1"]


def _parse(argv: list[str]) -> argparse.Namespace:
    """The options ``python -m bench`` hands the section: its own flags, --device and --plot."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plot", type=Path)
    logprobs.add_arguments(parser.add_argument_group("logprobs"))
    return parser.parse_args(argv)


def _expected(problem: logprobs.Problem, skip: tuple[str, ...] = ()) -> set[str]:
    """The variants a table must show here: those whose peer or entry point is available."""
    return {name for name, (_, available) in problem.variants.items() if available("cpu") is None} - set(skip)


def _in_process(setup: Any, kwargs: dict[str, Any], *, device: str = "cpu", warmup: int = 1, repeats: int = 3,
                timeout: float = 600.0) -> bench_measure.Measurement:
    """``bench.harness.measure.measure`` without the child process (what the child runs, in this one)."""
    return bench_measure.run_spec({"setup": reference(setup), "kwargs": kwargs, "device": device,
                                   "warmup": warmup, "repeats": repeats})


def _check_rows(table: dict[str, Any], expected: set[str]) -> None:
    # columns: variant, time (ms), x baseline, x compiled, peak extra (MiB), x baseline, x compiled, status
    rows = {row[0]: row for row in table["rows"]}
    assert set(rows) == expected, table
    assert rows[logprobs.BASELINE][2] == 1
    for name, (_, ms, time_ratio, _, mib, mem_ratio, _, status) in rows.items():
        assert status == "ok", (name, status)
        assert math.isfinite(ms) and ms > 0, (name, ms)
        assert math.isfinite(time_ratio) and time_ratio > 0, (name, time_ratio)
        assert math.isfinite(mib) and mib >= 0, (name, mib)
        # a peak of 0 above the inputs is possible for the chunked variants at tiny shapes;
        # the ratio is missing only where the baseline's own peak was 0
        assert mem_ratio is None or (math.isfinite(mem_ratio) and mem_ratio >= 0), (name, mem_ratio)


def test_quick_run_measures_two_tables_and_full_all_three():
    assert list(logprobs.resolve_shapes(_parse([]))) == list(logprobs.QUICK_TABLES)
    assert list(logprobs.resolve_shapes(_parse(["--logprobs-full"]))) == list(logprobs.PROBLEMS)
    assert list(logprobs.resolve_shapes(_parse(["--logprobs-tables", "distill_logits"]))) == ["distill_logits"]
    assert logprobs.count(_parse([])) == sum(len(logprobs.PROBLEMS[k].variants) for k in logprobs.QUICK_TABLES)


def test_section_tables_hold_every_available_variant(monkeypatch):
    monkeypatch.setattr(logprobs, "measure", _in_process)
    others = [n for p in logprobs.PROBLEMS.values() for n in p.variants if n != logprobs.COMPILED]
    args = _parse(TINY + ["--logprobs-tables", "all", "--logprobs-variants", ",".join(dict.fromkeys(others))])
    section = logprobs.run(args, lambda text: None)
    tables = [t.to_json() for t in section.tables]
    assert len(tables) == len(logprobs.PROBLEMS)
    for key, table in zip(logprobs.PROBLEMS, tables):
        problem = logprobs.PROBLEMS[key]
        assert table["title"].startswith(problem.title)
        _check_rows(table, _expected(problem, skip=(logprobs.COMPILED,)))
        for name, (_, available) in problem.variants.items():
            if available("cpu"):
                assert any(note.startswith(f"{name}: not measured") for note in table["notes"]), table["notes"]
        assert table["command"].startswith(f"python -m bench --only logprobs --logprobs-tables {key} --logprobs-n 64")


def test_shapes_quick_full_and_overrides():
    parse = _parse
    quick = logprobs.resolve_shapes(parse([]))
    assert {s.ns for s in quick.values()} == {(1024,)} and {(s.h, s.v) for s in quick.values()} == {(512, 16384)}
    full = logprobs.resolve_shapes(parse(["--logprobs-full"]))
    assert full["logprobs"] == logprobs.Shapes((4096,), 1024, 32768, (1024, 2048, 4096))
    assert full["distill_hidden"].ns == (1024, 2048) and full["distill_logits"].ns == (4096,)
    some = logprobs.resolve_shapes(parse(["--logprobs-full", "--logprobs-n", "8,16", "--logprobs-tables",
                                          "distill_logits"]))
    assert some == {"distill_logits": logprobs.Shapes((8, 16), 1024, 32768, (1024, 2048, 4096))}
    with pytest.raises(SystemExit, match="unknown"):
        logprobs.resolve_shapes(parse(["--logprobs-tables", "nope"]))


def test_baseline_formulas_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(16, 50, generator=g, dtype=torch.float64) * 3, torch.randn(16, 50, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (16,), generator=g)
    logp, entropy = logprobs_steps.logprobs_and_entropy(s, labels)
    p = s.softmax(-1)
    torch.testing.assert_close(logp, p[torch.arange(16), labels].log())
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    for beta in (0.25, 0.5, 0.9):
        ps, pt = s.softmax(-1), t.softmax(-1)
        m = beta * pt + (1 - beta) * ps
        truth = (beta * (pt * (pt / m).log()).sum(-1) + (1 - beta) * (ps * (ps / m).log()).sum(-1)).mean()
        torch.testing.assert_close(logprobs_steps.generalized_jsd(s, t, beta), truth)


def test_trl_kernels_agree_with_the_baseline_formulas():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl not installed")
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    h, w = logprobs_steps._projection(32, 16, 300, "fp32", "cpu", seed=0, grad=False)
    th, tw = logprobs_steps._projection(32, 16, 300, "fp32", "cpu", seed=2, grad=False)
    labels = torch.randint(0, 300, (32,), generator=torch.Generator().manual_seed(1))
    logp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, labels, 0.7, 128, None, 1.0, ("entropy",))
    ref_logp, ref_entropy = logprobs_steps.logprobs_and_entropy(F.linear(h, w) / 0.7, labels)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    jsd = ChunkedDivergenceFunction.apply(h, w, None, th, tw, None, logprobs_steps.BETA, 0.7)[0].mean()
    torch.testing.assert_close(jsd, logprobs_steps.generalized_jsd(F.linear(h, w) / 0.7, F.linear(th, tw) / 0.7))


@pytest.mark.slow  # one child process per variant, three of them compiling: about a minute
def test_section_end_to_end_with_compiled_variants(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--only", "logprobs", *TINY, "--logprobs-tables", "all", "--no-progress",
                           "--json", str(out), "--out", str(tmp_path / "report")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tables = json.loads(out.read_text())["sections"]["logprobs"]["tables"]
    assert len(tables) == len(logprobs.PROBLEMS)
    for problem, table in zip(logprobs.PROBLEMS.values(), tables):
        _check_rows(table, _expected(problem))


def test_plot_draws_time_and_memory_per_problem(tmp_path):
    by_n = {n: {"a": {"seconds": 0.01 * n, "peak_extra_bytes": 2**20 * n}, "b": {"seconds": 0.02,
                                                                                "peak_extra_bytes": 0}}
            for n in (64, 128)}
    problems = {key: {"h": 32, "v": 512, "sweep": by_n} for key in logprobs.PROBLEMS}
    paths = logprobs.plot(Section("logprobs", [], data={"dtype": "bf16", "problems": problems}), tmp_path)
    stems = [p.stem for p in logprobs.PROBLEMS.values()]
    assert [Path(p).name for p in paths] == [f"{s}_{m}.png" for s in stems for m in ("time", "memory")]
    for p in paths:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
