"""Run the packing tests on one Transformers release per supported epoch.

Each release is installed once into its own ``--target`` directory under ``.tf-matrix/``
(gitignored, reused between runs) with the exact huggingface_hub / tokenizers versions it
needs, and the tests run in a subprocess with ``PYTHONPATH`` pointing there, so the project's
own virtualenv (and its newest Transformers) stays untouched.

    python .ci/transformers_matrix.py                 # every release below
    python .ci/transformers_matrix.py --releases 5.3.0 -k "llama"

The release installed in the virtualenv itself is tested by the main ``pytest`` run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".tf-matrix"

# release -> (epoch, extra pins installed with --no-deps next to it). Pins are what pip's
# resolver picks for that release where the virtualenv's versions are outside its range.
RELEASES: dict[str, tuple[str, list[str]]] = {
    "4.57.6": ("4.53-5.3", [
        "huggingface_hub==0.36.2", "tokenizers==0.22.2", "requests==2.34.2",
        "charset-normalizer==3.5.3", "urllib3==2.8.0", "certifi==2026.10.19.post1",
        # Trainer's module imports datasets; the virtualenv's release needs huggingface_hub 2
        "datasets==4.4.1", "httpx==0.29.0", "httpcore==1.0.9",
    ]),
    "5.3.0": ("4.53-5.3", [
        "huggingface_hub==1.33.0", "tokenizers==0.22.2", "httpx==0.29.0", "httpcore==1.0.9",
        "certifi==2026.10.19.post1",
    ]),
    "5.22.2": ("5.4-5.23", []),
    "5.25.0": ("5.24+", []),
}

# One release per epoch by default, less the one the virtualenv holds (the main pytest run tests
# it); 5.3.0, the last of the 4.53-5.3 epoch, with --releases 5.3.0. The default matrix takes about
# 2 minutes on 2 cores.
DEFAULT_RELEASES = ["4.57.6", "5.22.2", "5.25.0"]

# What runs per release: the whole oracle except FlexAttention (its CPU compile costs ~10-40 s
# per family and release; flex runs for llama on every release and for all families in the
# main run), plus the registry checks, the collator's refusal, Trainer's resume and the tiled
# feed-forwards (whose router outputs each release records its own way) on that release.
TESTS = [
    "tests/model_patches/packing/test_packing.py",
    "tests/model_patches/packing/test_packing_registry.py",
    "tests/model_patches/packing/test_packing_generation.py",
    "tests/model_patches/packing/test_collator_leak.py",
    "tests/model_patches/test_checkpoint_resume.py",
    "tests/ac_policies/test_ac_tile.py",  # MoE router outputs recorded per release (block output or hooks)
]
DEFAULT_K = "not flex_attention or llama"
#: The files of a release run two at a time (pytest-xdist, from the test extra), one worker per core.
XDIST = ["-n", "2", "--dist", "loadfile"] if importlib.util.find_spec("xdist") else []


def install(version: str) -> tuple[str, float]:
    target = CACHE / version
    marker = target / ".complete"
    if marker.exists():
        return version, 0.0
    t0 = time.perf_counter()
    pins = RELEASES[version][1]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target),
           f"transformers=={version}", *pins]
    subprocess.run(cmd, check=True)
    marker.write_text(" ".join(cmd[cmd.index("--target") + 2:]) + "\n")
    return version, time.perf_counter() - t0


def run_tests(version: str, k: str) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=str(CACHE / version))
    check = "import transformers, sys; assert transformers.__version__ == sys.argv[1], transformers.__version__"
    subprocess.run([sys.executable, "-c", check, version], check=True, env=env, cwd=ROOT)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", k, *XDIST, *TESTS]
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    return rc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", nargs="+", choices=list(RELEASES),
                   help=f"releases (default: {' '.join(DEFAULT_RELEASES)}, less the virtualenv's own)")
    p.add_argument("-k", default=DEFAULT_K, help=f"pytest -k expression (default: {DEFAULT_K!r})")
    args = p.parse_args(argv)
    if args.releases is None:
        own = importlib.metadata.version("transformers")
        args.releases = [v for v in DEFAULT_RELEASES if v != own]
        if len(args.releases) < len(DEFAULT_RELEASES):
            print(f"transformers {own}: the virtualenv's own release, tested by the main pytest run", flush=True)
    CACHE.mkdir(exist_ok=True)
    t_all = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args.releases)) as pool:  # network-bound
        installed = dict(pool.map(install, args.releases))
    rows, failed = [], []
    for version in args.releases:
        print(f"\n=== transformers {version} (epoch {RELEASES[version][0]}) ===", flush=True)
        rc, seconds = run_tests(version, args.k)
        rows.append((version, RELEASES[version][0], installed[version], seconds, "ok" if rc == 0 else f"FAILED rc={rc}"))
        if rc:
            failed.append(version)
    print("\nrelease   epoch      install(s)  tests(s)  result")
    for v, epoch, inst, sec, res in rows:
        print(f"{v:<9} {epoch:<10} {inst:>10.1f} {sec:>9.1f}  {res}")
    print(f"matrix total {time.perf_counter() - t_all:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
