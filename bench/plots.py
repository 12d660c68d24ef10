"""PNG plots shared by the loss sections: one line per variant against the token count N."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def lines_vs_n(by_n: dict[Any, dict[str, dict[str, Any]]], out_dir: Path, *, stem: str, title: str) -> list[Path]:
    """Write ``{stem}_time.png`` and ``{stem}_memory.png`` from ``{N: {variant: measurement dict}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in by_n)
    variants = list(next(iter(by_n.values())))
    paths = []
    for key, label, scale, fname in (
        ("seconds", "forward+backward time (ms)", 1e3, "time"),
        ("peak_extra_bytes", "peak extra memory (MiB)", 1 / 2**20, "memory"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        floor = None
        values = [m.get(key) for row in by_n.values() for m in row.values() if m.get(key)]
        if values:
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
