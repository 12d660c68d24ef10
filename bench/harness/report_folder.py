"""The report folder of one ``python -m bench`` run: ``report.md``, ``report.json`` and ``plots/``.

``report.md`` holds the run's facts (date, machine, library versions, commit, command, the CPU's
capability and the dtype each section runs in and why), every section's tables with their
baselines, notes and reproduce commands, and the PNG plots embedded; ``report.json`` holds the same
figures (what ``python -m bench --compare`` reads) and the raw data each section measured.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from bench.harness import host_dtype
from bench.harness.host_dtype import DtypeChoice
from bench.harness.report import Section


def default_folder(now: Optional[float] = None) -> Path:
    """``bench-reports/YYYY-MM-DD_HHMMSS`` under the working directory."""
    return Path("bench-reports") / time.strftime("%Y-%m-%d_%H%M%S", time.localtime(now))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    """The source tree's commit (``+dirty`` with uncommitted changes), or "unknown"."""
    here = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_facts(device: str, argv: Sequence[str],
              dtypes: Optional[Mapping[str, DtypeChoice]] = None) -> dict[str, Any]:
    """What a reader needs to trust or reproduce the figures; ``dtypes`` maps each section's part
    to the dtype it runs in and why (see :mod:`bench.harness.host_dtype`)."""
    import torch

    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m bench " + " ".join(shlex.quote(a) for a in argv),
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu()}, {os.cpu_count()} cores, "
                   f"{torch.get_num_threads()} torch threads",
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    if device.startswith("cpu"):
        facts["cpu capability"] = host_dtype.host_capability()
    if dtypes:
        facts["dtypes"] = {name: choice.to_json() for name, choice in dtypes.items()}
    return facts


def fact_lines(facts: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, text)`` of each fact but the date, the dtypes one line per section part
    (``dtype lce``: ``fp32 - why``)."""
    lines = []
    for key, value in facts.items():
        if key == "date":
            continue
        if key == "dtypes":
            lines += [(f"dtype {name}", f"{c['dtype']} - {c['reason']}") for name, c in value.items()]
        else:
            lines.append((key, str(value)))
    return lines


def to_json(facts: dict[str, Any], sections: Sequence[tuple[str, Section]], plots: dict[str, list[str]]) -> dict:
    return {"facts": facts, "sections": {name: s.to_json() for name, s in sections}, "plots": plots}


def to_markdown(facts: dict[str, Any], sections: Sequence[tuple[str, Section]], plots: dict[str, list[str]],
                comparison: Optional[str] = None) -> str:
    out = ["# Benchmark report", ""]
    if "date" in facts:
        out.append(f"- **date**: {facts['date']}")
    out += [f"- **{key}**: `{value}`" if key in ("command", "commit") else f"- **{key}**: {value}"
            for key, value in fact_lines(facts)]
    out += ["", "Every table measures its variants side by side in this run; ratios are against the "
            "baseline it names. Reproduce a table with its command.", ""]
    if comparison:
        out += ["## Compared with an earlier run", "", "```", comparison, "```", ""]
    for name, section in sections:
        out += [f"## {section.name} (`{name}`)", ""]
        for table in section.tables:
            out += [table.to_markdown(), ""]
        for path in plots.get(name, []):
            out += [f"![{Path(path).stem}]({path})", ""]
    return "\n".join(out).rstrip() + "\n"


def write(folder: Path, facts: dict[str, Any], sections: Sequence[tuple[str, Section]],
          plots: dict[str, list[Path]], comparison: Optional[str] = None) -> dict[str, Path]:
    """Write ``report.md`` and ``report.json`` into ``folder`` (the plots are already under
    ``folder / "plots"``); return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    relative = {name: [os.path.relpath(p, folder) for p in paths] for name, paths in plots.items()}
    json_path, md_path = folder / "report.json", folder / "report.md"
    json_path.write_text(json.dumps(to_json(facts, sections, relative), indent=2, default=str))
    md_path.write_text(to_markdown(facts, sections, relative, comparison))
    return {"markdown": md_path, "json": json_path}

