"""Run the test suite on the torch releases users run: the newest, the floor, and a few between.

Each release gets its own virtualenv under ``.torch-matrix/<version>/`` (gitignored), created once
and reused (a ``.complete`` marker holds the install time and ``pip freeze``), with that torch and
the project's dependencies (``pyproject.toml``: the dependencies and the ``test`` and ``trainers``
extras, resolved by pip against the pinned torch). The project itself is not installed: pytest
runs from the repository root, where ``pythonpath = ["."]`` puts the checkout's packages first,
and a check before the run asserts that the imported packages are the checkout's and torch is the
release asked for.

    python .ci/torch_matrix.py                              # CI: DEFAULT_RELEASES, DEFAULT_TESTS
    python .ci/torch_matrix.py --releases 2.14.1 2.15.0 --full
    python .ci/torch_matrix.py --releases 2.6.0 --tests tests/functional_ce -x
    python .ci/torch_matrix.py --releases 2.15.0 --install-only

Tests run on 2 pytest-xdist processes by file (``--workers``), with ``CI=true`` and a compile
cache per release. Options pytest knows (``-x``, ``--maxfail=3``) are passed on to it. torch comes
from PyPI (a CUDA build, about 3 GB with the nvidia libraries; it runs on the CPU) unless pip's
configuration names a local folder. pip's torch cap (a constraint file named in pip's
configuration, where there is one) is lifted for these installs only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".torch-matrix"

# Releases with what each one stands for. Any other release can be named with --releases.
RELEASES: dict[str, str] = {
    "2.15.0": "newest",
    "2.14.1": "previous",
    "2.13.0": "the floor; CI's main virtualenv",
    "2.12.1": "below the floor",
    "2.6.0": "below the floor",
}
# The floor runs the whole suite in CI's main virtualenv (.ci/run); the matrix adds the newest.
DEFAULT_RELEASES = ["2.15.0"]

# CI's subset: one file for each torch API that changes between releases (custom ops and their
# fake kernels, DTensor vocabulary parallelism, FSDP2, pipelining, torch.compile of masks and of
# checkpointed models, selective checkpointing), about a minute on 2 cores; --full runs the whole
# default profile (the nightly run does, on every release in RELEASES above the floor).
DEFAULT_TESTS = [
    "tests/functional_ce/test_linear_ce.py",              # custom ops, torch's F.linear_cross_entropy
    "tests/functional_ce/distributed/test_pipeline_loss.py",          # torch.distributed.pipelining
    "tests/model_patches/loss/test_causal_lm_loss_fsdp.py",    # FSDP2 fully_shard, DTensor
    "tests/model_patches/packing/test_packing_compile.py",        # compiled attention masks, fullgraph
    "tests/ac_policies/test_ac_op_sac.py",                # selective checkpointing contexts
    "tests/ac_policies/test_ac_compose.py",               # policies under torch.compile and FSDP2
    "tests/ac_policies/test_ac_tile.py",                  # per-slice checkpoint regions, compiled blocks
]

PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]

CHECK = """\
import sys, torch, functional_ce, model_patches, ac_policies
root, want = sys.argv[1], sys.argv[2]
for m in (functional_ce, model_patches, ac_policies):
    assert m.__file__.startswith(root), f"{m.__name__} from {m.__file__}, not the checkout {root}"
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__}, asked for {want}"
print(f"torch {torch.__version__} from {torch.__file__}")
"""


def requirements(version: str) -> list[str]:
    """The project's dependencies and the extras CI installs (test, bench, trainers) from
    pyproject.toml, torch pinned to ``version``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("test", "bench", "trainers"):
        reqs += project["optional-dependencies"][extra]
    name = lambda r: re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("_", "-")  # noqa: E731
    reqs = [r for r in reqs if name(r) != "torch"]
    # pytest-xdist for --workers (the test extra has it too)
    xdist = [] if any(name(r) == "pytest-xdist" for r in reqs) else ["pytest-xdist>=3"]
    return [f"torch=={version}", *reqs, *xdist]


def venv_python(version: str) -> Path:
    return CACHE / version / "bin" / "python"


def install(version: str) -> tuple[str, float | None]:
    """Create the release's virtualenv once, and bring it up to date when the requirements changed
    since (pip installs what is missing); the seconds it took (None: reused as it was)."""
    venv = CACHE / version
    marker = venv / ".complete"
    if marker.exists():
        if json.loads(marker.read_text())["command"][4:] == requirements(version):
            return version, None
    elif venv.exists():  # an interrupted install: start again
        shutil.rmtree(venv)
    t0 = time.perf_counter()
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # PIP_CONSTRAINT in the environment overrides a constraint set in pip's configuration files.
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null")
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    cmd = [str(venv_python(version)), "-m", "pip", "install", "-q", *requirements(version)]
    print(f"[{version}] {' '.join(cmd[1:])}", flush=True)
    log = venv / "install.log"
    with open(log, "w") as out:
        rc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"torch {version}: pip install failed (rc={rc}), {log}:\n" + "\n".join(tail))
    seconds = time.perf_counter() - t0
    freeze = subprocess.run([str(venv_python(version)), "-m", "pip", "freeze"], check=True,
                            capture_output=True, text=True).stdout
    marker.write_text(json.dumps({"seconds": round(seconds, 1), "command": cmd[1:],
                                  "freeze": freeze.splitlines()}, indent=1) + "\n")
    print(f"[{version}] installed in {seconds:.0f} s", flush=True)
    return version, seconds


def versions(version: str) -> str:
    """transformers / trl versions pip resolved for the release (from the marker's freeze)."""
    freeze = json.loads((CACHE / version / ".complete").read_text())["freeze"]
    pins = dict(line.split("==", 1) for line in freeze if "==" in line)
    return f"transformers {pins.get('transformers', '?')}, trl {pins.get('trl', '?')}"


def run_tests(version: str, tests: list[str], k: str | None, workers: int,
              extra: list[str]) -> dict:
    venv = CACHE / version
    python = str(venv_python(version))
    env = {key: val for key, val in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        CI="true",
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        # One compile cache per release, kept with its virtualenv.
        TORCHINDUCTOR_CACHE_DIR=str(venv / "inductor-cache"),
    )
    row = {"rc": 0, "seconds": 0.0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    check = subprocess.run([python, "-c", CHECK, str(ROOT), version], env=env, cwd=ROOT,
                           capture_output=True, text=True)
    print(check.stdout + check.stderr, end="", flush=True)
    if check.returncode:  # the packages do not import on this release
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        return dict(row, rc=check.returncode, failures=[f"import: {last[:300]}"], result="import failed")
    junit = venv / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [python, *PYTEST, f"--junitxml={junit}"]
    if workers > 0:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    if k:
        cmd += ["-k", k]
    cmd += [*extra, *tests]
    print(" ".join(["python", *cmd[1:]]), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    row.update(rc=rc, seconds=time.perf_counter() - t0)
    if junit.exists():
        row.update(parse_junit(junit))
    return row


def parse_junit(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            counts["failures"].append(name + " (error)")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", nargs="+", default=DEFAULT_RELEASES, metavar="VERSION",
                   help=f"torch releases (default: {' '.join(DEFAULT_RELEASES)}); "
                        f"known: {', '.join(f'{v} ({n})' for v, n in RELEASES.items())}")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--tests", nargs="+", default=None, metavar="PATH",
                      help=f"test paths (default: {' '.join(DEFAULT_TESTS)})")
    what.add_argument("--full", action="store_true",
                      help="the whole default profile (pyproject's testpaths, not slow)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="pytest-xdist processes, --dist loadfile (default 2; 0: one process)")
    p.add_argument("--install-only", action="store_true",
                   help="create the virtualenvs, run nothing")
    args, extra = p.parse_known_args(argv)
    for arg in extra:
        if not arg.startswith("-"):
            p.error(f"unrecognized argument {arg!r} (test paths go after --tests)")
    tests = [] if args.full else (args.tests or DEFAULT_TESTS)
    CACHE.mkdir(exist_ok=True)
    t_all = time.perf_counter()
    installed: dict[str, float | None] = {}
    broken: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args.releases)) as pool:  # network-bound
        futures = {pool.submit(install, v): v for v in args.releases}
        for future in concurrent.futures.as_completed(futures):
            try:
                installed.update([future.result()])
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                broken[futures[future]] = str(exc)
                print(exc, file=sys.stderr, flush=True)
    if args.install_only:
        for v in args.releases:
            if v in installed:
                inst = installed[v]
                print(f"{v}: {'reused' if inst is None else f'{inst:.0f} s'}, {versions(v)}")
        return 1 if broken else 0
    rows = {}
    for version in args.releases:
        if version in broken:
            continue
        about = "; ".join(filter(None, [RELEASES.get(version), versions(version)]))
        print(f"\n=== torch {version} ({about}) ===", flush=True)
        rows[version] = run_tests(version, tests, args.k, args.workers, extra)
    print(f"\ntests: {' '.join(tests) or 'the default profile'}"
          + (f"  -k {args.k!r}" if args.k else "") + (f"  {' '.join(extra)}" if extra else ""))
    print("release  install(s)  passed  failed  errors  skipped  tests(s)  result")
    for v in args.releases:
        if v in broken:
            print(f"{v:<8} {'-':>10}  install failed")
            continue
        r, inst = rows[v], installed[v]
        print(f"{v:<8} {'reused' if inst is None else f'{inst:.0f}':>10}  {r['passed']:>6}  "
              f"{r['failed']:>6}  {r['errors']:>6}  {r['skipped']:>7}  {r['seconds']:>8.0f}  "
              + ("ok" if r["rc"] == 0 else r.get("result", f"FAILED rc={r['rc']}")))
    for v, r in rows.items():
        for name in r["failures"]:
            print(f"  {v} failed: {name}")
    print(f"matrix total {time.perf_counter() - t_all:.0f} s")
    return 1 if broken or any(r["rc"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
