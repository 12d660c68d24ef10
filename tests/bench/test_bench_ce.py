"""The ``ce`` section of ``python -m bench`` end to end at a tiny shape, and its plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.report import Section
from bench.sections.ce import section as ce_logits


@pytest.mark.slow  # five child processes compiling at first use: 30-60 s; the losses are tested elsewhere
def test_ce_section_reports_every_variant_with_its_baseline(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "ce", "--ce-shape", "64,512", "--ce-repeats", "1",
         "--no-progress", "--json", str(out),
         "--out", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reproduce: python -m bench --only ce --ce-shape 64,512" in proc.stdout
    table = json.loads(out.read_text())["sections"]["ce"]["tables"][0]
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert set(rows) == set(ce_logits.VARIANTS)
    assert rows["torch eager"]["x baseline"] == 1
    for name in ("torch eager", "torch compiled", "functional_ce", "functional_ce inplace"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["time (ms)"] > 0
        assert rows[name]["peak extra (MiB)"] >= 0
    assert rows["liger (CUDA)"]["status"] in ("not installed", "CUDA only")


def test_plot_draws_time_and_memory_against_tokens(tmp_path):
    by_n = {
        n: {"a": {"seconds": 0.01 * n, "peak_extra_bytes": 2**20 * n}, "b": {"seconds": 0.02, "peak_extra_bytes": 0}}
        for n in (64, 128, 256)
    }
    section = Section("ce", [], data={"dtype": "bf16", "sweep": {"v": 512, "by_n": by_n}})
    paths = ce_logits.plot(section, tmp_path)
    assert [p.name for p in paths] == ["ce_logits_time.png", "ce_logits_memory.png"]
    for p in paths:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
