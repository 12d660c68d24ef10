"""Quick and full runs of ``python -m bench``.

The default run is quick: every section at a small shape that still shows its point, the whole
report in about three minutes on a 2-core CPU. ``--full`` runs what ``bench/RESULTS.md`` reports:
every target shape, 2 and 4 processes, the N sweeps and their plots. A section's own flags (its
shape, its process counts...) override either.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional


def is_full(args: argparse.Namespace) -> bool:
    """Whether this run is ``--full``."""
    return bool(getattr(args, "full", False))


def pick(args: argparse.Namespace, given: Any, quick: Any, full: Any) -> Any:
    """``given`` (a section flag the user set), else the quick or the full default."""
    if given is not None:
        return given
    return full if is_full(args) else quick


def override(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A copy of ``args`` with ``changes`` (one table of a section at another shape)."""
    return argparse.Namespace(**{**vars(args), **changes})


def sweeps(args: argparse.Namespace) -> bool:
    """Whether to measure the N sweeps that the plots draw: with ``--plot`` or ``--full``."""
    return bool(getattr(args, "plot", None)) or is_full(args)


def shape_list(args: argparse.Namespace, given: Optional[str], quick: list[str], full: list[str]) -> list[str]:
    """A section's shapes: those of its flag (several separated by ``;``), else the quick or full ones."""
    parsed = [x.strip() for x in given.split(";") if x.strip()] if given else None
    return pick(args, parsed or None, quick, full)


def per_shape(args: argparse.Namespace, flag: str, shapes: list[str], table: Callable,
              tick: Callable[[str], None]) -> tuple[list, dict[str, Any]]:
    """``table(args with flag=shape, tick) -> (Table, data)`` for each shape: the tables, and the
    first shape's data with every shape's ``results`` under ``by_shape``."""
    tables, data = [], {}
    for shape in shapes:
        t, shape_data = table(override(args, **{flag: shape}), tick)
        tables.append(t)
        data = data or shape_data
        data.setdefault("by_shape", {})[shape] = shape_data["results"]
    return tables, data
