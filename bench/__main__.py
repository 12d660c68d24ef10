"""``python -m bench``: the one-command report, one section per package.

Each section is a folder ``bench/sections/<key>/``, named as its ``--only`` key, whose ``section``
module has ``run(args, tick) -> Section``, and optionally
``add_arguments(parser)``, ``count(args) -> int`` (the progress steps it will take, for the
estimate of the time left), ``dtypes(args) -> {part: DtypeChoice}`` (the dtype each part runs in
and why, :mod:`bench.harness.host_dtype`; printed first and kept in the report) and
``plot(section, out_dir) -> list[Path]``. ``tick(text)`` advances the progress display. Every
run leaves a report folder (``--out``, see :mod:`bench.harness.report_folder`); ``--compare OLD.json``
sets each ratio next to an earlier run's (:mod:`bench.harness.compare`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from bench.harness import compare, isolated, report_folder
from bench.harness.host_dtype import DTYPE_NAMES, DtypeChoice
from bench.harness.report import Section, Table

logger = logging.getLogger("bench")
T = TypeVar("T")

#: The section keys (``--only``), in the report's order. Each is a folder ``bench/sections/<key>/``
#: whose ``section`` module is the section.
SECTION_KEYS = ("train", "ce", "lce", "logprobs", "trl", "dist", "packing", "ac")
SECTIONS = {key: f"bench.sections.{key}.section" for key in SECTION_KEYS}


INSTALL_PLOTS = "Install it with: pip install -e '.[bench]' (or pip install matplotlib)"
NO_PLOTS = f"matplotlib is not installed: this run measures everything and writes the report without plots. {INSTALL_PLOTS}"
NO_PROGRESS = "tqdm is not installed: no progress display. Install it with: pip install -e '.[bench]' (or pip install tqdm)"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (matplotlib, tqdm: the ``bench`` extra)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: import blocked
        return False


def plotting_available() -> bool:
    """Whether matplotlib can be imported; without it the report has no plots."""
    return installed("matplotlib")


def _available() -> dict[str, object]:
    mods = {}
    for name, mod in SECTIONS.items():
        if importlib.util.find_spec(mod) is not None:
            mods[name] = importlib.import_module(mod)
    return mods


def build_parser(mods: dict[str, object]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(mods), help="run only these sections")
    p.add_argument("--full", action="store_true",
                   help="what bench/RESULTS.md reports: every target shape, 2 and 4 processes, the N sweeps and "
                        "their plots (an hour or more on a 2-core CPU; the default run is quick, about 2.5 minutes)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="the report folder: report.md, report.json and plots/ (default bench-reports/DATE_TIME)")
    p.add_argument("--compare", type=Path, metavar="OLD.json",
                   help="compare every ratio with an earlier run's report.json; flag those that moved beyond the noise")
    p.add_argument("--compare-floor", type=float, default=compare.TIME_FLOOR, metavar="F",
                   help=f"with --compare, the smallest relative move of a time ratio that is flagged (default "
                        f"{compare.TIME_FLOOR}: run-to-run noise of a shared CPU; lower it on a quiet machine)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON to PATH")
    p.add_argument("--plot", type=Path, metavar="DIR",
                   help="measure the N sweeps and write PNG plots into DIR (and into the report folder)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="the dtype of every section's losses (a section's own --*-dtype wins; the dist FSDP2 "
                        "and pipeline steps stay fp32); default: what the host runs fast, bf16 on CUDA and on "
                        "CPUs with bf16 matrix units (AVX512_BF16, AMX), else fp32 where a step has matmuls; the "
                        "report says which and why")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, mod in mods.items():
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p.add_argument_group(f"section {name}"))
    return p


def _header(facts: dict[str, object]) -> str:
    """The run's facts (see :func:`bench.harness.report_folder.run_facts`) as the first lines printed."""
    return f"# bench report {facts['date']}\n" + "\n".join(f"{k}: {v}" for k, v in report_folder.fact_lines(facts))


def section_dtypes(mods: dict[str, object], args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """Each chosen section's parts -> the dtype it runs in and why (sections with ``dtypes``)."""
    out: dict[str, DtypeChoice] = {}
    for mod in mods.values():
        if hasattr(mod, "dtypes"):
            out.update(mod.dtypes(args))
    return out


class Progress:
    """One line, updated in place: the section and variant running, how many steps are done of
    the planned total (each section's ``count(args)``, where it has one) and tqdm's estimate of
    the time left. Silent without tqdm or with ``--no-progress``."""

    def __init__(self, total: Optional[int], enabled: bool) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # the bench extra is not installed
            tqdm = None
        self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True) \
            if tqdm is not None and enabled else None
        self.done_before = 0  # planned steps of the sections already finished

    def tick(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text[:60])
            self.bar.update(1)

    def section_done(self, planned: Optional[int]) -> None:
        """Re-anchor on the plan: a section may take more or fewer steps than it planned."""
        if self.bar is None:
            return
        if planned is not None and self.bar.total is not None:
            self.done_before += planned
            self.bar.n = self.done_before
            self.bar.refresh()
        self.bar.clear()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _summary(sections: list, seconds: dict[str, float], argv: list[str]) -> Section:
    """One row per section: its wall time, its tables and the rows that did not measure (an error,
    a missing peer)."""
    rows = []
    for name, _, section in sections:
        statuses = [row[-1] for table in section.tables for row in table.rows
                    if table.columns and table.columns[-1] == "status"]
        ok = sum(s == "ok" for s in statuses)
        rows.append([name, round(seconds[name], 1), len(section.tables), ok, len(statuses) - ok])
    rows.append(["all", round(sum(seconds.values()), 1), sum(r[2] for r in rows), sum(r[3] for r in rows),
                 sum(r[4] for r in rows)])
    table = Table(title="summary: what ran, and how long", columns=["section", "wall time (s)", "tables",
                                                                    "rows ok", "rows not measured"],
                  rows=rows, command="python -m bench " + " ".join(shlex.quote(a) for a in argv),
                  notes=["rows not measured: a peer that is not installed or runs on CUDA only, fit() refusing a "
                         "budget no table reaches, or an error (its status says which)"])
    return Section(name="summary", tables=[table])


def _planned(mod: object, args: argparse.Namespace) -> Optional[int]:
    count = getattr(mod, "count", None)
    return None if count is None else int(count(args))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    isolated.start()  # its imports overlap the sections' below
    mods = _available()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(mods).parse_args(argv)
    chosen = {n: m for n, m in mods.items() if not args.only or n in args.only}
    old = compare.load(args.compare) if args.compare else None  # a bad file fails before hours of work
    folder = args.out or report_folder.default_folder()
    plot_dir = folder / "plots"
    planned = {n: _planned(m, args) for n, m in chosen.items()}
    total = None if None in planned.values() else sum(planned.values())
    progress = Progress(total, enabled=not args.no_progress)
    facts = report_folder.run_facts(args.device, argv, section_dtypes(chosen, args))
    plotting = plotting_available()
    if args.plot and not plotting:  # asked for plots: say so before hours of measuring
        build_parser(mods).error(f"--plot needs matplotlib, which is not installed. {INSTALL_PLOTS}")

    print(_header(facts), flush=True)
    if not plotting:
        print(f"\n{NO_PLOTS}", flush=True)
    if not args.no_progress and not installed("tqdm"):
        print(f"\n{NO_PROGRESS}", flush=True)
    sections, seconds, failures = [], {}, []
    for name, mod in chosen.items():
        start = time.perf_counter()
        section = mod.run(args, progress.tick)
        seconds[name] = time.perf_counter() - start
        sections.append((name, mod, section))
        progress.section_done(planned[name])
        _attempt(failures, f"rendering section {name}", lambda: print("\n" + section.render(), flush=True))
        # on disk after every section: whatever fails later, what was measured stays
        _attempt(failures, "writing the report", lambda: report_folder.write(
            folder, facts, [(n, s) for n, _, s in sections], {}), once=True)
    progress.close()
    summary = _summary(sections, seconds, argv)
    _attempt(failures, "rendering the summary", lambda: print("\n" + summary.render(), flush=True))
    named = [(n, s) for n, _, s in sections] + [("summary", summary)]
    comparison = None
    if old is not None:
        def compared() -> None:
            nonlocal comparison
            payload = report_folder.to_json(facts, named, {})
            changes = compare.compare(old, payload, time_floor=args.compare_floor)
            comparison = compare.render(changes, old_name=str(args.compare))  # every ratio, in the report
            print("\n## Compared with " + str(args.compare) + "\n"
                  + compare.render(changes, old_name=str(args.compare), only_flagged=True), flush=True)
        _attempt(failures, f"comparing with {args.compare}", compared)
    # the tables and figures first, then the plots, then the report again with the plots in it
    paths = _attempt(failures, "writing the report", lambda: report_folder.write(folder, facts, named, {}, comparison))
    plots: dict[str, list[Path]] = {}
    if plotting:
        plot_dir.mkdir(parents=True, exist_ok=True)
        for name, mod, section in sections:
            if hasattr(mod, "plot"):  # [] without N sweeps (measured with --plot)
                plots[name] = _attempt(failures, f"plotting section {name}", lambda: list(mod.plot(section, plot_dir))) or []
                if args.plot and plots[name]:
                    args.plot.mkdir(parents=True, exist_ok=True)
                    for path in plots[name]:
                        shutil.copy2(path, args.plot / path.name)
        if any(plots.values()):
            paths = _attempt(failures, "writing the report with its plots",
                             lambda: report_folder.write(folder, facts, named, plots, comparison)) or paths
    if paths and args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(paths["json"], args.json)
        print(f"\nwrote {args.json}")
    if paths:
        print(f"\nreport: {paths['markdown']} (figures: {paths['json']}, plots: {sum(map(len, plots.values()))} in "
              f"{plot_dir})")
    if failures:
        print(f"\n{len(failures)} step(s) after measuring failed; every figure measured is in {folder}:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    return 0


def _attempt(failures: list[str], what: str, action: Callable[[], T], once: bool = False) -> Optional[T]:
    """``action()``, or None with the failure logged and added to ``failures`` (named by ``what``;
    with ``once``, a failure already listed under that name is not listed again)."""
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - reported at the end; the measured figures must survive it
        logger.exception("python -m bench: %s failed", what)
        entry = f"{what}: {type(exc).__name__}: {exc}"
        if not (once and any(f.startswith(what + ":") for f in failures)):
            failures.append(entry)
        return None


if __name__ == "__main__":
    sys.exit(main())
