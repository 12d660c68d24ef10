"""`bench ac` at a tiny size: every variant reports a step peak next to kept bytes, against none."""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest


@pytest.mark.slow  # about a minute on 2 cores; step_bytes itself is tested in the default run
@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_bench_ac_reports_step_peak_next_to_kept_bytes():
    from bench.sections.ac import section as ac

    args = argparse.Namespace(ac_seq=32, ac_layers=1, ac_repeats=1, ac_time_budget=0.0, ac_sensitivity="on",
                              ac_budgets="off", ac_estimate="off", device="cpu")
    section = ac.run(args, tick=lambda msg: None)
    results = section.data["results"]
    for name, r in results.items():
        assert r["peak"] >= r["live"] > 0, name  # the peak includes what forward keeps
    assert results["full"]["live"] < results["none"]["live"]
    table, shapes = section.tables
    assert "step peak (MiB)" in table.columns
    assert len(shapes.rows) == 4  # the model above and three more MoE shapes, each with peak ratios
    assert all(0 < row[4] <= 1.0 for row in shapes.rows)  # non_moe peak x none


@pytest.mark.slow  # fit() three times and four compiles per model: about a minute on 2 cores
@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_bench_ac_budget_tables_fit_within_budget():
    from bench.sections.ac import budgets as ac_budgets

    args = argparse.Namespace(ac_budgets_at=ac_budgets.FULL_BUDGETS, ac_budgets_seq=32, ac_budgets_layers=2, device="cpu")
    tables, data = ac_budgets.run(args, tick=lambda msg: None)
    assert data["budgets"] == [0.5, 0.7, 0.9]
    assert [t.title.split(": ")[-1].split(" (")[0] for t in tables] == ["dense Llama", "Qwen3-MoE"]
    for table, kind in zip(tables, ("dense", "moe")):
        names = [row[0] for row in table.rows]
        presets = ["full", "selective"] + (["non_moe"] if kind == "moe" else [])
        budgets = [f"fit({b})" for b in data["budgets"]]
        compiled = [f"torch.compile budget={b}" for b in (1.0, *data["budgets"])]
        assert names == ["none", *presets, *budgets, *compiled]
        col = {c: i for i, c in enumerate(table.columns)}
        none = table.rows[0]
        assert none[col["x none"]] == 1 and none[col["recompute (GFLOP)"]] == 0
        for row in table.rows:
            if row[0].startswith("fit("):
                # a fit row either meets its budget or says fit() refused it
                if row[col["status"]] == "ok":
                    assert row[col["within budget"]] == "yes", row
                    assert row[col["step peak (MiB)"]] <= row[col["budget (MiB)"]], row
                else:
                    assert row[col["status"]].startswith("refused: "), row
            if row[0].startswith("torch.compile"):
                assert row[col["status"]] == "ok", row
                assert row[col["recompute (GFLOP)"]] >= 0, row
        fitted = data["models"][kind]
        assert any(r["status"] == "ok" for k, r in fitted.items() if k.startswith("fit(")), kind
        # bytes are counted only inside the compiled graphs: a step Dynamo ran eagerly would show 0
        base = fitted["torch.compile budget=1.0"]
        assert base["peak"] > 0
        # the compiled backward's FLOPs (MoE experts' custom op included) are eager's at budget 1.0
        assert base["backward_flops"] == pytest.approx(fitted["none"]["backward_flops"], rel=0.05)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_bench_ac_offload_refuses_without_cuda(capsys):
    from bench.sections.ac import offload as ac_offload

    assert ac_offload.main(["--layers", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow  # two child processes at sequence 256, each builds a 32k-vocabulary model: about a minute
def test_bench_ac_estimate_measures_each_case_in_its_own_process(monkeypatch):
    from bench.sections.ac import estimate as ac_estimate

    cases = [("llama", "none", False), ("llama", "full", True)]
    monkeypatch.setattr(ac_estimate, "QUICK_CASES", cases)  # the quick run's cases (no --full here)
    args = argparse.Namespace(ac_estimate="on", ac_estimate_seq=256)
    tables, data = ac_estimate.run(args, tick=lambda msg: None)
    assert len(tables) == 1 and len(tables[0].rows) == 2
    for r in data:
        assert "error" not in r, r
        assert abs(r["estimated_peak"] / r["measured_peak"] - 1) <= ac_estimate.TARGETS["live"], r
        # a fresh process per case: the resident-set peak is the step's, not 0 or a leftover's
        assert abs(r["estimated_step_extra"] / r["rss_extra"] - 1) <= ac_estimate.TARGETS["rss"], r
    assert ac_estimate.run(argparse.Namespace(ac_estimate="off"), tick=lambda msg: None) == ([], [])


def test_no_bench_module_imports_the_tests_package():
    root = pathlib.Path(__file__).resolve().parents[2] / "bench"
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        assert not [m for m in imported if m == "tests" or m.startswith("tests.")], name


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_bench_ac_estimate_cuda_refuses_without_cuda(capsys, tmp_path):
    from bench.sections.ac import estimate_cuda as ac_estimate_cuda

    assert ac_estimate_cuda.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
