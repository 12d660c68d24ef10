"""``python -m bench --compare OLD.json``: every ratio of this run next to an earlier run's.

Tables are matched by title (a title names the shape, dtype and device), rows by their key columns,
ratios by column (the columns named ``x ...``). A time ratio is flagged when it moved by more than
the noise the two reports measured: twice the largest spread (``(max - min) / median`` of the
timed steps) of any row of that table in either run, and never less than a floor
(:data:`TIME_FLOOR` by default, ``--compare-floor``). The floor is there because each variant runs
in a process of its own: on a shared 2-core CPU, two runs of unchanged code moved time ratios by up
to 39% while the steps within each run spread by at most 13% (bench/RESULTS.md), so a move within
50% says nothing there; on a quiet machine a lower floor catches smaller regressions. A memory
ratio is flagged when it moved by more than :data:`MEMORY_FLOOR` (peaks are nearly deterministic).
Either way a move smaller than :data:`ABSOLUTE_FLOOR` in the ratio itself is not flagged (tiny
ratios jitter by whole MiB).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

#: The smallest relative move of a time ratio that is flagged by default.
TIME_FLOOR = 0.5
#: The smallest relative move of a memory ratio that is flagged.
MEMORY_FLOOR = 0.10
#: A move of a ratio smaller than this is never flagged.
ABSOLUTE_FLOOR = 0.02


@dataclasses.dataclass(frozen=True)
class Change:
    """One ratio of one row, in the old and the new run."""

    section: str
    table: str
    row: str
    column: str
    kind: str  # "time" or "memory"
    old: Optional[float]
    new: Optional[float]
    threshold: float  # the relative move beyond which it is flagged
    flagged: bool

    @property
    def moved(self) -> Optional[float]:
        """``new / old - 1``; None where either is missing or the old one is 0."""
        if self.old is None or self.new is None or self.old == 0:
            return None
        return self.new / self.old - 1.0


def load(path: Path) -> dict[str, Any]:
    """A ``report.json`` (or a ``--json`` file) of an earlier run."""
    payload = json.loads(Path(path).read_text())
    if "sections" not in payload:
        raise ValueError(f"{path} is not a bench report: it has no 'sections'")
    return payload


def _ratio_columns(columns: list[str]) -> list[tuple[int, str, str]]:
    """``(index, name, kind)`` of each ratio column; its kind is that of the nearest measured
    column before it (a time or a memory column)."""
    out, kind = [], "time"
    for i, name in enumerate(columns):
        lower = name.lower()
        if lower.startswith("x "):
            out.append((i, f"{name} ({kind})", kind))
        elif "time" in lower or "(ms)" in lower or "(s)" in lower:
            kind = "time"
        elif "mib" in lower or "memory" in lower or "peak" in lower or "bytes" in lower:
            kind = "memory"
    return out


def _number(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _rows(table: dict[str, Any]) -> dict[str, list[Any]]:
    keys = table.get("keys", 1)
    return {" / ".join(str(c) for c in row[:keys]): row for row in table["rows"]}


def _noise(table: dict[str, Any]) -> float:
    spread = table.get("spread") or {}
    return max(spread.values(), default=0.0)


def compare(old: dict[str, Any], new: dict[str, Any], *, time_floor: float = TIME_FLOOR) -> list[Change]:
    """Every ratio present in both runs, with whether it moved beyond the noise (a time ratio
    never by less than ``time_floor``, relative)."""
    changes = []
    for section, new_section in new["sections"].items():
        old_section = old["sections"].get(section)
        if old_section is None:
            continue
        old_tables = {t["title"]: t for t in old_section["tables"]}
        for table in new_section["tables"]:
            before = old_tables.get(table["title"])
            if before is None:
                continue
            time_threshold = max(time_floor, 2.0 * max(_noise(table), _noise(before)))
            old_rows = _rows(before)
            for name, row in _rows(table).items():
                if name not in old_rows:
                    continue
                for i, column, kind in _ratio_columns(table["columns"]):
                    a, b = _number(old_rows[name][i]), _number(row[i])
                    threshold = time_threshold if kind == "time" else MEMORY_FLOOR
                    flagged = (a is not None and b is not None and a != 0 and abs(b / a - 1.0) > threshold
                               and abs(b - a) > ABSOLUTE_FLOOR)
                    changes.append(Change(section, table["title"], name, column, kind, a, b, threshold, flagged))
    return changes


def render(changes: list[Change], *, old_name: str = "old", only_flagged: bool = False) -> str:
    """A text table of the changes (all of them, or the flagged ones), flagged rows first."""
    shown = [c for c in changes if c.flagged or not only_flagged]
    if not changes:
        return f"no table of this run is in {old_name} (compare runs of the same sections and shapes)"
    flagged = sum(c.flagged for c in changes)
    head = f"{len(changes)} ratios compared with {old_name}; {flagged} moved beyond the run-to-run noise"
    lines = [head]
    width = max((len(c.row) for c in shown), default=10)
    for c in sorted(shown, key=lambda c: (not c.flagged, c.section, c.table)):
        moved = "-" if c.moved is None else f"{c.moved:+.0%}"
        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        mark = "FLAGGED" if c.flagged else "ok"
        lines.append(f"{mark:7}  {c.row:{width}}  {c.column:24}  {fmt(c.old):>8} -> {fmt(c.new):>8}  "
                     f"{moved:>6} (noise {c.threshold:.0%})  [{c.section}] {c.table}")
    return "\n".join(lines)
