"""Each script of ``examples/`` runs at its ``--tiny`` size in a process of its own, exits 0 and
prints a finite loss. The chunk maths run uncompiled here (``FUNCTIONAL_CE_COMPILE=0``): the
compiled path is tested elsewhere, and a first compile would cost more than the examples."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
NEEDS = {"accelerate_fsdp2_trainer.py": ("accelerate",), "grpo_trl_heads.py": ("trl", "datasets"), "sft_trainer.py": ("accelerate",)}


def test_every_example_is_listed():
    assert EXAMPLES == ["accelerate_fsdp2_trainer.py", "distillation.py", "fsdp2_loop.py", "grpo_trl_heads.py", "pipeline_last_stage.py",
                        "sft_trainer.py"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_prints_a_finite_loss(name):
    for module in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}")
    env = {**os.environ, "FUNCTIONAL_CE_COMPILE": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss:? (\S+)", done.stdout) if re.fullmatch(r"[-+0-9.eE]+|nan|inf", x)]
    assert losses and all(math.isfinite(x) for x in losses), done.stdout[-2000:]
