"""The files of the distribution a user call crosses, traced (``sys.settrace``): how many, and
whether a call leaves a file and comes back into it. ``docs/design.md`` draws the path of
``linear_cross_entropy``; this keeps it that short."""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

import functional_ce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("functional_ce", "model_patches", "ac_policies", "patch_layer")


def crossed(call: Callable[[], object]) -> tuple[list[str], list[str]]:
    """(the package files entered, in order; the call chains that re-enter a file they left)."""
    files: list[str] = []
    reentered: list[str] = []

    def tracer(frame, event, arg):
        if event != "call":
            return None
        chain, f = [], frame
        while f is not None:
            rel = os.path.relpath(f.f_code.co_filename, ROOT)
            if rel.split(os.sep)[0] in PACKAGES and (not chain or chain[-1] != rel):
                chain.append(rel)
            f = f.f_back
        chain.reverse()
        if chain and chain[-1] not in files:
            files.append(chain[-1])
        if len(chain) != len(set(chain)):
            reentered.append(" > ".join(chain))
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return files, reentered


def test_linear_cross_entropy_crosses_ten_files_and_enters_none_twice(monkeypatch):
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(500, 32, requires_grad=True)
    labels = torch.randint(0, 500, (64,))

    def step():
        functional_ce.linear_cross_entropy(hidden, weight, labels).backward()

    step()  # the first call's imports and registrations are not the path
    files, reentered = crossed(step)
    assert not reentered, reentered
    assert len(files) <= 10, files
    assert files[0] == os.path.join("functional_ce", "loss.py")
