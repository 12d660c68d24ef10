"""PNG plots shared by the loss sections: one line per variant against the token count N."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

#: (measurement key, axis label, scale to the axis unit, file suffix) of the default plots.
TIME_AND_MEMORY = (
    ("seconds", "forward+backward time (ms)", 1e3, "time"),
    ("peak_extra_bytes", "peak extra memory (MiB)", 1 / 2**20, "memory"),
)


def lines_vs_n(by_n: dict[Any, dict[str, dict[str, Any]]], out_dir: Path, *, stem: str, title: str,
               metrics: Sequence[tuple[str, str, float, str]] = TIME_AND_MEMORY) -> list[Path]:
    """Write ``{stem}_{suffix}.png`` per metric (default: time and memory) from
    ``{N: {variant: measurement dict}}``; a metric every variant measured as 0 gets no plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in by_n)
    variants = list(next(iter(by_n.values())))
    paths = []
    for key, label, scale, fname in metrics:
        values = [m.get(key) for row in by_n.values() for m in row.values() if m.get(key)]
        if not values:
            continue  # every variant measured 0 (or nothing): no log-axis plot to draw
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        floor = min(values) * scale / 10  # a measured 0 is drawn here, on the log axis
        for var in variants:
            pts = [(n, by_n[n if n in by_n else str(n)][var].get(key)) for n in ns]
            pts = [(n, max(y * scale, floor)) for n, y in pts if y is not None and floor is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=var)
        if floor is not None and any(
            m.get(key) == 0 for row in by_n.values() for m in row.values()
        ):
            ax.axhline(floor, color="grey", lw=0.8, ls=":")
            ax.annotate("measured 0", (ns[0], floor), fontsize=7, color="grey", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"{stem}_{fname}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def sweep_plots(by_n: Optional[dict[Any, dict[str, dict[str, Any]]]], out_dir: Path, *, stem: str, what: str,
                sizes: dict[str, Any], details: Sequence[str],
                metrics: Sequence[tuple[str, str, float, str]] = TIME_AND_MEMORY) -> list[Path]:
    """The plots of one table's N sweep ``by_n`` (:func:`lines_vs_n`), titled ``what, H=..., V=...,
    details`` (``sizes``: the dimensions the sweep holds fixed); none where no sweep was measured."""
    if not by_n:
        return []
    title = ", ".join([what, *(f"{k}={x}" for k, x in sizes.items()), *details])
    return lines_vs_n(by_n, out_dir, stem=stem, title=title, metrics=metrics)
