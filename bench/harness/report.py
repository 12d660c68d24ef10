"""Report building blocks shared by every bench section: tables with units and a baseline."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional


@dataclasses.dataclass
class Table:
    """One table of a report.

    ``columns`` carry their units (``"time (ms)"``); ``rows`` hold plain values (str, int,
    float or None, shown as "-"). ``baseline`` names the row every ratio is taken against;
    ``command`` is the exact command line that reproduces the table.
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    command: str
    baseline: Optional[str] = None
    notes: list[str] = dataclasses.field(default_factory=list)
    #: How many leading columns name a row (``--compare`` matches rows by them).
    keys: int = 1
    #: Row name (its key columns joined by " / ") -> the ``(max - min) / median`` spread of its
    #: timed steps, where it had several: the run-to-run noise ``--compare`` judges time ratios by.
    spread: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        wrong = [i for i, row in enumerate(self.rows) if len(row) != len(self.columns)]
        if wrong:
            raise ValueError(f"table {self.title!r}: row {wrong[0]} has {len(self.rows[wrong[0]])} cells for "
                             f"{len(self.columns)} columns")

    def row_name(self, row: list[Any]) -> str:
        return " / ".join(str(c) for c in row[: self.keys])

    def to_markdown(self) -> str:
        """The table as Markdown: a heading, the table, the baseline, notes and the command."""
        def cell(v: Any) -> str:
            return _fmt(v).replace("|", "\\|")

        out = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
               "|" + "|".join(" --- " if i < self.keys else " ---: " for i in range(len(self.columns))) + "|"]
        out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        out.append("")
        if self.baseline:
            out.append(f"Baseline: {self.baseline}")
            out.append("")
        out += [f"- {n}" for n in self.notes]
        out += ["", f"Reproduce: `{self.command}`"]
        return "\n".join(out)

    def render(self) -> str:
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))  # noqa: E731
        out = [f"### {self.title}", line(self.columns), line(["-" * w for w in widths])]
        out += [line(r) for r in cells]
        if self.baseline:
            out.append(f"baseline: {self.baseline}")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"reproduce: {self.command}")
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": self.columns,
            "rows": [[_json_value(v) for v in row] for row in self.rows],
            "baseline": self.baseline,
            "notes": self.notes,
            "command": self.command,
            "keys": self.keys,
            "spread": self.spread,
        }


@dataclasses.dataclass
class Section:
    """A package's part of the report."""

    name: str
    tables: list[Table]
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw figures for --json / plots

    def render(self) -> str:
        return "\n\n".join([f"## {self.name}"] + [t.render() for t in self.tables])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tables": [t.to_json() for t in self.tables], "data": self.data}


def spreads(measurements: dict[str, Any]) -> dict[str, float]:
    """``name -> spread`` of the measurements (``bench.harness.measure.Measurement``) that have one."""
    return {name: m.spread for name, m in measurements.items() if getattr(m, "spread", None) is not None}


def ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """``value / base``, or None when either is missing or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return f"{v:.2e}"
    return str(v)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v
