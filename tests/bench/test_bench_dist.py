"""The ``dist`` section of ``python -m bench`` end to end at a tiny shape on 2 gloo processes,
and its plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.report import Section
from bench.sections.dist import section as dist


# 12 spawned processes, about 45 s on 2 cores: nightly (the losses are tested in test_ce_vocab_parallel).
@pytest.mark.slow
def test_dist_section_reports_every_variant_with_bytes_and_its_baseline(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, FUNCTIONAL_CE_COMPILE="0")  # eager chunk maths: no compile in 12 processes
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "dist", "--dist-shape", "64,500", "--dist-hidden-shape",
         "32,16,500", "--dist-fsdp-shape", "256,32,500", "--dist-pipeline-shape", "256,32,500", "--dist-worlds", "2",
         "--dist-cp-shape", "512,32,500,1", "--dist-cp-worlds", "1,2",
         "--dist-repeats", "1", "--dist-models", "on", "--out", str(tmp_path / "report"),
         "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reproduce: python -m bench --only dist --dist-shape 64,500" in proc.stdout
    tables = json.loads(out.read_text())["sections"]["dist"]["tables"]
    logits_table, hidden_table, fsdp_table, pipeline_table, cp_table = tables
    for table, variants, baseline in ((logits_table, dist.LOGITS_VARIANTS, dist.LOGITS_BASELINE),
                                      (hidden_table, dist.HIDDEN_VARIANTS, dist.HIDDEN_BASELINE),
                                      (fsdp_table, dist.FSDP_VARIANTS, dist.FSDP_BASELINE),
                                      (pipeline_table, dist.PIPELINE_VARIANTS, dist.PIPELINE_BASELINE)):
        rows = {row[1]: dict(zip(table["columns"], row)) for row in table["rows"]}
        assert set(rows) == set(variants)
        assert rows[baseline]["x baseline"] == 1
        for name, row in rows.items():
            assert row["status"] == "ok", (name, row)
            assert row["ranks"] == 2 and row["time (ms)"] > 0 and row["peak extra/rank (MiB)"] >= 0
    logits = {row[1]: dict(zip(logits_table["columns"], row)) for row in logits_table["rows"]}
    # Ours: two all-reduces of fp32 statistics (12 bytes per token), nothing in backward.
    for name in ("functional_ce", "functional_ce inplace"):
        assert logits[name]["fwd bytes/token/rank"] == 12 and logits[name]["bwd MiB/rank"] == 0
    # Gathering the bf16 logits hands over this rank's 250 classes x 2 bytes per token.
    assert logits["full_tensor + functional_ce"]["fwd bytes/token/rank"] == 500
    hidden = {row[1]: dict(zip(hidden_table["columns"], row)) for row in hidden_table["rows"]}
    # One [N, H] hidden-gradient reduction in backward, in the hidden states' dtype (the host's
    # default: bf16 where the CPU has bf16 matrix units, else fp32)
    dtype = json.loads(out.read_text())["facts"]["dtypes"]["dist hidden"]["dtype"]
    assert hidden["functional_ce.linear_cross_entropy"]["bwd MiB/rank"] == 32 * 16 * {"fp32": 4, "bf16": 2}[dtype] / 2**20
    # FSDP2: the hidden-state loss gathers and reduces exactly what the model's own step does.
    fsdp = {row[1]: dict(zip(fsdp_table["columns"], row)) for row in fsdp_table["rows"]}
    ours, own = fsdp["model_patches.causal_lm_loss"], fsdp[dist.FSDP_BASELINE]
    assert ours["fwd bytes/token/rank"] == own["fwd bytes/token/rank"] > 0
    assert ours["bwd MiB/rank"] == own["bwd MiB/rank"] > 0
    # Context parallelism: the baseline gathers nothing; 2 processes gather keys and values
    cp = {row[0]: dict(zip(cp_table["columns"], row)) for row in cp_table["rows"]}
    assert set(cp) == {1, 2} and all(row["status"] == "ok" for row in cp.values())
    assert cp[1]["x one process"] == 1 and cp[1]["fwd MiB/process"] == 0 < cp[2]["fwd MiB/process"]
    assert cp[2]["tokens/process"] == 256


def test_plot_draws_memory_bytes_and_time_against_tokens(tmp_path):
    def sweep(variants, backward_bytes):
        return {"world": 2, "by_n": {
            n: {v: {"seconds": 0.01 * n, "peak_extra_bytes": 2**20 * n, "forward_bytes": 12 * n,
                    "backward_bytes": backward_bytes * n} for v in variants}
            for n in (64, 128)
        }}

    data = {"logits": {"shape": [64, 500], "dtype": "bf16", "sweep": sweep(dist.LOGITS_VARIANTS, 0)},
            "hidden": {"shape": [64, 16, 500], "dtype": "fp32", "sweep": sweep(dist.HIDDEN_VARIANTS, 64)}}
    paths = dist.plot(Section("dist", [], data=data), tmp_path)
    # Backward bytes from logits are 0 for every variant: no plot on log axes for them.
    assert [p.name for p in paths] == [
        "dist_logits_memory.png", "dist_logits_forward_bytes.png", "dist_logits_time.png",
        "dist_hidden_memory.png", "dist_hidden_forward_bytes.png", "dist_hidden_backward_bytes.png",
        "dist_hidden_time.png",
    ]
    for p in paths:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
