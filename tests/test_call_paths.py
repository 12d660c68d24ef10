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

    prefixes = tuple(os.path.join(ROOT, package) + os.sep for package in PACKAGES)

    def tracer(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(prefixes):
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


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_the_patch_and_estimate_paths_enter_no_file_twice(monkeypatch):
    import ac_policies
    import model_patches

    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")
    model = _tiny_llama()

    def step(m: torch.nn.Module) -> torch.Tensor:
        ids = torch.randint(0, 128, (1, 16))
        return m(input_ids=ids, labels=ids).loss

    calls = {
        "enable_packing(model)": lambda: model_patches.enable_packing(model).remove(),
        "apply_policy": lambda: ac_policies.apply_policy(model, "full").remove(),
        "estimate": lambda: ac_policies.estimate(model, step),
    }
    for name, call in calls.items():
        call()  # the first call's imports are not the path
        files, reentered = crossed(call)
        assert files and not reentered, (name, reentered)
