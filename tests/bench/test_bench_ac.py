"""`bench ac` at a tiny size: every variant reports a step peak next to kept bytes, against none."""

from __future__ import annotations

import argparse

import pytest


@pytest.mark.slow  # about a minute on 2 cores; step_bytes itself is tested in the default run
@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_bench_ac_reports_step_peak_next_to_kept_bytes():
    from bench import ac

    args = argparse.Namespace(ac_seq=32, ac_layers=1, ac_repeats=1, ac_time_budget=0.0, ac_sensitivity="on",
                              device="cpu")
    section = ac.run(args, tick=lambda msg: None)
    results = section.data["results"]
    for name, r in results.items():
        assert r["peak"] >= r["live"] > 0, name  # the peak includes what forward keeps
    assert results["full"]["live"] < results["none"]["live"]
    table, shapes = section.tables
    assert "step peak (MiB)" in table.columns
    assert len(shapes.rows) == 4  # the model above and three more MoE shapes, each with peak ratios
    assert all(0 < row[4] <= 1.0 for row in shapes.rows)  # non_moe peak x none


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_bench_ac_offload_refuses_without_cuda(capsys):
    from bench import ac_offload

    assert ac_offload.main(["--layers", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
