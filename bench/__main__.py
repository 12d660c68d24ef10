"""``python -m bench``: the one-command report, one section per package.

Each section is a module of this package with ``run(args, tick) -> Section``, and optionally
``add_arguments(parser)`` and ``plot(section, out_dir) -> list[Path]``. ``tick(text)`` advances
the progress display.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

# name -> module; order is the report's order.
SECTIONS = {
    "ce": "bench.ce_logits",
    "lce": "bench.ce_hidden",
    "logprobs": "bench.logprobs",
    "dist": "bench.dist",
    "packing": "bench.packing",
    "ac": "bench.ac",
}


def _available() -> dict[str, object]:
    mods = {}
    for name, mod in SECTIONS.items():
        if importlib.util.find_spec(mod) is not None:
            mods[name] = importlib.import_module(mod)
    return mods


def build_parser(mods: dict[str, object]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(mods), help="run only these sections")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON to PATH")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, mod in mods.items():
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p.add_argument_group(f"section {name}"))
    return p


def _header() -> str:
    cpu = platform.processor() or platform.machine()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({cpu}, {torch.get_num_threads()} threads)"
    return (
        f"# bench report {time.strftime('%Y-%m-%d %H:%M')}\n"
        f"torch {torch.__version__}, python {platform.python_version()}, {dev}\n"
        f"command: python -m bench {' '.join(shlex.quote(a) for a in sys.argv[1:])}".rstrip()
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    mods = _available()
    args = build_parser(mods).parse_args(argv)
    chosen = {n: m for n, m in mods.items() if not args.only or n in args.only}
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed
        tqdm = None
    bar = None if (tqdm is None or args.no_progress) else tqdm(unit="step", file=sys.stderr)

    def tick(text: str) -> None:
        if bar is not None:
            bar.set_description(text[:60])
            bar.update(1)

    print(_header(), flush=True)
    sections = []
    for name, mod in chosen.items():
        section = mod.run(args, tick)
        sections.append((name, mod, section))
        if bar is not None:
            bar.clear()
        print("\n" + section.render(), flush=True)
    if bar is not None:
        bar.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"header": _header(), "sections": {n: s.to_json() for n, _, s in sections}}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")
    if args.plot:
        args.plot.mkdir(parents=True, exist_ok=True)
        for _, mod, section in sections:
            if hasattr(mod, "plot"):
                for path in mod.plot(section, args.plot):
                    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
