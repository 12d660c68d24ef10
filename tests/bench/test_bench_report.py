"""The report folder of ``python -m bench`` and ``--compare`` against an earlier run, on synthetic
reports: a slowed variant is flagged, noise and unchanged figures are not."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
from pathlib import Path

import pytest

from bench.__main__ import SECTION_KEYS, main
from bench.harness import compare, modes, report_folder
from bench.harness.report import Section, Table

COLUMNS = ["variant", "time (ms)", "x baseline", "peak extra (MiB)", "x baseline", "status"]


def _section(times: dict[str, float], peaks: dict[str, float], spread: dict[str, float]) -> Section:
    base_t, base_m = times["eager"], peaks["eager"]
    rows = [[name, t, t / base_t, peaks[name], peaks[name] / base_m, "ok"] for name, t in times.items()]
    table = Table(title="a loss, forward+backward, [64, 512] bf16 on cpu", columns=COLUMNS, rows=rows,
                  command="python -m bench --only ce --ce-shape 64,512", baseline="eager: the full path",
                  notes=["a note"], spread=spread)
    return Section(name="functional_ce: a loss", tables=[table], data={})


def _report(section: Section) -> dict:
    return report_folder.to_json({"date": "today"}, [("ce", section)], {})


TIMES = {"eager": 100.0, "compiled": 60.0, "ours": 50.0}
PEAKS = {"eager": 400.0, "compiled": 300.0, "ours": 40.0}


def test_a_run_compared_with_itself_flags_nothing():
    old = _report(_section(TIMES, PEAKS, {"eager": 0.05, "ours": 0.04}))
    changes = compare.compare(old, copy.deepcopy(old))
    assert len(changes) == 6  # 3 rows x (a time and a memory ratio)
    assert not any(c.flagged for c in changes)
    assert all(c.moved == 0 for c in changes if c.moved is not None)


def test_noise_within_the_measured_spread_is_not_flagged():
    old = _report(_section(TIMES, PEAKS, {"eager": 0.2, "ours": 0.1}))
    # ours 25% slower, the baseline unchanged: within 2 x the 20% spread this table measured
    new = _report(_section({**TIMES, "ours": 62.5}, PEAKS, {"eager": 0.2, "ours": 0.1}))
    (ours_time,) = [c for c in compare.compare(old, new, time_floor=0.1) if c.row == "ours" and c.kind == "time"]
    assert ours_time.moved == pytest.approx(0.25) and ours_time.threshold == pytest.approx(0.4)
    assert not ours_time.flagged
    # with the default floor, a 25% move is within the noise of one process per variant too
    (default,) = [c for c in compare.compare(old, new) if c.row == "ours" and c.kind == "time"]
    assert default.threshold == compare.TIME_FLOOR and not default.flagged
    # a 30% move beyond a quiet machine's lower floor and small spreads is flagged
    quiet_old = _report(_section(TIMES, PEAKS, {"eager": 0.01, "ours": 0.01}))
    quiet_new = _report(_section({**TIMES, "ours": 65.0}, PEAKS, {"eager": 0.01, "ours": 0.01}))
    (quiet,) = [c for c in compare.compare(quiet_old, quiet_new, time_floor=0.1) if c.row == "ours" and c.kind == "time"]
    assert quiet.threshold == pytest.approx(0.1) and quiet.flagged


def test_a_slowed_variant_and_a_memory_regression_are_flagged():
    old = _report(_section(TIMES, PEAKS, {"eager": 0.03, "ours": 0.02}))
    new = _report(_section({**TIMES, "ours": 100.0}, {**PEAKS, "compiled": 360.0}, {"eager": 0.03, "ours": 0.02}))
    changes = compare.compare(old, new)
    flagged = {(c.row, c.kind) for c in changes if c.flagged}
    assert flagged == {("ours", "time"), ("compiled", "memory")}
    (slowed,) = [c for c in changes if c.row == "ours" and c.kind == "time"]
    assert slowed.old == pytest.approx(0.5) and slowed.new == pytest.approx(1.0)
    assert slowed.threshold == compare.TIME_FLOOR  # 2 x 3% spread is below the floor
    text = compare.render(changes, old_name="old.json")
    assert text.splitlines()[0] == "6 ratios compared with old.json; 2 moved beyond the run-to-run noise"
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["FLAGGED", "FLAGGED", "ok", "ok", "ok", "ok"]


def test_tables_rows_and_sections_absent_from_the_old_run_are_skipped():
    old = _report(_section(TIMES, PEAKS, {}))
    new = _report(_section({**TIMES, "new variant": 10.0}, {**PEAKS, "new variant": 1.0}, {}))
    new["sections"]["other"] = new["sections"]["ce"]
    assert {c.row for c in compare.compare(old, new)} == {"eager", "compiled", "ours"}
    assert compare.render([], old_name="x.json").startswith("no table of this run is in x.json")


def test_load_refuses_a_file_that_is_not_a_report(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a bench report"):
        compare.load(path)


def test_report_folder_holds_markdown_json_and_the_plots(tmp_path):
    plot = tmp_path / "out" / "plots" / "ce_logits_time.png"
    plot.parent.mkdir(parents=True)
    plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    facts = report_folder.run_facts("cpu", ["--only", "ce"])
    assert {"date", "command", "commit", "torch", "transformers", "machine", "device"} <= set(facts)
    assert facts["command"] == "python -m bench --only ce"
    paths = report_folder.write(tmp_path / "out", facts, [("ce", _section(TIMES, PEAKS, {"ours": 0.1}))],
                                {"ce": [plot]}, comparison="1 ratios compared")
    md = paths["markdown"].read_text()
    assert "| variant | time (ms) | x baseline | peak extra (MiB) | x baseline | status |" in md
    assert "| ours | 50.0 | 0.5 | 40.0 | 0.1 | ok |" in md
    assert "Reproduce: `python -m bench --only ce --ce-shape 64,512`" in md
    assert "![ce_logits_time](plots/ce_logits_time.png)" in md
    assert "## Compared with an earlier run" in md and f"**torch**: {facts['torch']}" in md
    payload = json.loads(paths["json"].read_text())
    assert payload["sections"]["ce"]["tables"][0]["spread"] == {"ours": 0.1}
    assert payload["plots"] == {"ce": ["plots/ce_logits_time.png"]}


def test_modes_pick_the_flag_then_the_quick_or_full_default():
    quick, full = argparse.Namespace(full=False), argparse.Namespace(full=True, plot=None)
    assert modes.pick(quick, None, 1, 2) == 1 and modes.pick(full, None, 1, 2) == 2
    assert modes.pick(full, 7, 1, 2) == 7
    assert not modes.sweeps(argparse.Namespace(full=False, plot=None))
    assert modes.sweeps(full) and modes.sweeps(argparse.Namespace(full=False, plot=Path("p")))
    assert modes.override(quick, full=True).full and not quick.full


@pytest.mark.slow  # a child process per variant, compiling: about a minute
def test_main_writes_the_folder_and_compares_with_an_earlier_run(tmp_path, capsys):
    argv = ["--only", "ce", "--ce-shape", "64,512", "--ce-repeats", "2", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert main(argv + ["--out", str(tmp_path / "b"), "--compare", str(tmp_path / "a" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "ratios compared with" in out
    assert (tmp_path / "b" / "report.md").read_text().count("## Compared with an earlier run") == 1


def _section_args(argv: list[str]) -> argparse.Namespace:
    """The options ``python -m bench`` hands every section, as its parser builds them."""
    from bench.__main__ import _available, build_parser

    return build_parser(_available()).parse_args(argv)


def test_quick_and_full_runs_plan_their_progress_steps():
    from bench.sections.ac import section as ac
    from bench.sections.ce import section as ce_logits
    from bench.sections.dist import section as dist
    from bench.sections.lce import section as ce_hidden
    from bench.sections.logprobs import section as logprobs
    from bench.sections.packing import section as packing

    quick, full = _section_args([]), _section_args(["--full"])
    for section in (ce_logits, ce_hidden, logprobs, dist, packing, ac):
        assert 0 < section.count(quick) < section.count(full), section.__name__
    # the flags a user sets win over either default
    assert dist.count(_section_args(["--full", "--dist-worlds", "2", "--dist-models", "off", "--dist-sweep", "64"])) \
        == len(dist.LOGITS_VARIANTS) + len(dist.HIDDEN_VARIANTS) + len(dist.LOGITS_VARIANTS) + len(dist.HIDDEN_VARIANTS)
    assert ce_logits.shapes(quick) == ce_logits.QUICK_SHAPES
    assert ce_logits.shapes(full) == ce_logits.FULL_SHAPES
    assert ce_logits.shapes(_section_args(["--ce-shape", "64,512;128,512"])) == ["64,512", "128,512"]
    assert logprobs.resolve_shapes(full) == logprobs.FULL


def test_progress_plans_the_total_and_reanchors_after_each_section():
    from bench.__main__ import Progress

    progress = Progress(total=10, enabled=True)
    assert progress.bar is not None and progress.bar.total == 10
    for _ in range(3):
        progress.tick("section a: variant")
    progress.section_done(5)  # a section that planned 5 steps and ticked 3
    assert progress.bar.n == 5
    progress.tick("section b: variant")
    progress.section_done(5)
    assert progress.bar.n == 10
    progress.close()
    assert Progress(total=None, enabled=False).bar is None


@pytest.mark.slow  # every section in child processes, some compiling: about 3 minutes on 2 cores
def test_default_run_every_section_end_to_end_at_tiny_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")  # eager chunk maths in every child process
    argv = ["--no-progress", "--out", str(tmp_path / "run"),
            "--ce-shape", "64,512", "--ce-repeats", "2",
            "--lce-shape", "64,32,512", "--lce-repeats", "2",
            "--logprobs-n", "64", "--logprobs-h", "32", "--logprobs-v", "512", "--trl-shape", "64", "32", "512",
            "--dist-shape", "64,500", "--dist-hidden-shape", "32,16,500", "--dist-repeats", "2",
            "--packing-families", "llama", "--packing-backends", "eager", "sdpa", "--packing-sweep", "llama",
            "--packing-docs", "200", "--packing-max-length", "512",
            "--ac-seq", "32", "--ac-layers", "1", "--ac-repeats", "2", "--ac-time-budget", "0"]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "run" / "report.json").read_text())
    assert list(payload["sections"]) == ["train", "ce", "lce", "logprobs", "trl", "dist", "packing", "ac", "summary"]
    # a peer that is absent, or fit() refusing a budget below what any table reaches at this shape
    peers_missing = ("not installed", "CUDA only", "refused: lowest peak")
    for name, section in payload["sections"].items():
        for table in section["tables"]:
            if table["columns"][-1] != "status":
                continue
            for row in table["rows"]:
                assert row[-1] == "ok" or any(p in row[-1] for p in peers_missing), (name, table["title"], row)
    (summary,) = payload["sections"]["summary"]["tables"]
    assert [row[0] for row in summary["rows"]] == ["train", "ce", "lce", "logprobs", "trl", "dist", "packing", "ac", "all"]
    md = (tmp_path / "run" / "report.md").read_text()
    assert md.count("Reproduce: `python -m bench") >= 12 and "![ac_presets](plots/ac_presets.png)" in md
    # the spreads --compare judges by were measured
    assert any(t["spread"] for s in payload["sections"].values() for t in s["tables"])


def _fake_sections(monkeypatch, plot) -> list[str]:
    """``python -m bench`` with two quick fake sections (each one table) whose ``plot`` is ``plot``;
    returns the log of what ran, in order."""
    import types

    import bench.__main__ as bench_main

    ran: list[str] = []

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(f"fake_{name}")

        def run(args, tick):
            ran.append(f"measure {name}")
            return _section(TIMES, PEAKS, {})

        def plot_section(section, out_dir):
            ran.append(f"plot {name}")
            return plot(out_dir)

        mod.run, mod.plot = run, plot_section
        return mod

    monkeypatch.setattr(bench_main, "_available", lambda: {"a": module("a"), "b": module("b")})
    monkeypatch.setattr(bench_main.isolated, "start", lambda: None)
    return ran


def test_a_failing_plot_keeps_every_figure_measured_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    def broken(out_dir):
        raise RuntimeError("the plotting library broke")

    ran = _fake_sections(monkeypatch, broken)
    assert main(["--no-progress", "--out", str(tmp_path)]) == 1
    assert ran == ["measure a", "measure b", "plot a", "plot b"]
    payload = json.loads((tmp_path / "report.json").read_text())
    assert list(payload["sections"]) == ["a", "b", "summary"]
    assert payload["sections"]["b"]["tables"][0]["rows"][2][0] == "ours"
    assert "Reproduce: `python -m bench --only ce" in (tmp_path / "report.md").read_text()
    err = capsys.readouterr().err
    assert "plotting section a: RuntimeError: the plotting library broke" in err and "plotting section b" in err


def test_without_matplotlib_the_run_says_so_first_and_writes_the_whole_report(tmp_path, monkeypatch, capsys):
    import sys

    ran = _fake_sections(monkeypatch, lambda out_dir: pytest.fail("plotted without matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the bench extra were not installed
    assert main(["--no-progress", "--out", str(tmp_path)]) == 0
    assert ran == ["measure a", "measure b"]
    out = capsys.readouterr().out
    assert out.index("matplotlib is not installed") < out.index("## ")  # before the first table
    assert "pip install -e '.[bench]'" in out
    assert list(json.loads((tmp_path / "report.json").read_text())["sections"]) == ["a", "b", "summary"]
    with pytest.raises(SystemExit):  # plots asked for: refused before measuring
        main(["--no-progress", "--out", str(tmp_path / "p"), "--plot", str(tmp_path / "plots")])
    assert ran == ["measure a", "measure b"] and "--plot needs matplotlib" in capsys.readouterr().err


def test_a_section_that_fails_to_render_keeps_the_others(tmp_path, monkeypatch, capsys):
    _fake_sections(monkeypatch, lambda out_dir: [])
    real = Section.render
    monkeypatch.setattr(Section, "render", lambda self: (_ for _ in ()).throw(ValueError("bad cell"))
                        if self.name != "summary" else real(self))
    assert main(["--no-progress", "--out", str(tmp_path)]) == 1
    assert list(json.loads((tmp_path / "report.json").read_text())["sections"]) == ["a", "b", "summary"]
    assert "rendering section a: ValueError: bad cell" in capsys.readouterr().err


def test_every_section_key_is_a_folder_of_that_name_and_the_top_level_stays_small():
    root = Path(__file__).resolve().parents[2] / "bench"

    folders = {p.name for p in (root / "sections").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SECTION_KEYS)
    for key in SECTION_KEYS:
        section = importlib.import_module(f"bench.sections.{key}.section")
        assert callable(section.run), key
    top = [p.name for p in root.iterdir() if p.name != "__pycache__"]
    assert len(top) <= 12, sorted(top)
