"""Resuming a MoE model in ``Trainer`` restores every weight as saved, with any of the library's
patches on: an interrupted run resumed in a new process equals the uninterrupted run's losses and
parameters (Qwen3-MoE and Mixtral). On Transformers 5.x ``save_pretrained`` writes the experts in
the Hub layout and Trainer's own load leaves them fresh (#48805); ``model_patches``' resume
conversion puts them back, and refuses loudly when a checkpoint does not convert."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import model_patches
from model_patches.checkpoint_resume import restore_checkpoint_layout
from tests.model_patches.workers.resume import run
from tests.support.tiny_models import tiny_loss_model

# Trainer's module imports datasets: an environment whose datasets and huggingface_hub disagree
# cannot run Trainer at all.
pytest.importorskip("transformers.trainer", exc_type=ImportError)

#: family -> the patch the resumed process trains with
CASES = {"qwen3_moe": "packing", "mixtral": "policy"}


def _converts() -> bool:
    """Whether the installed Transformers writes Hub-layout checkpoints (the records are admitted)."""
    return all(row.state != "skipped" for row in model_patches.resume_conversion_status())


def _resume_in_a_new_process(family: str, patch: str, out: str) -> dict:
    # the same import path as this process (the Transformers matrix puts a release in front)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)}
    done = subprocess.run([sys.executable, "-m", "tests.model_patches.workers.resume", family, patch, out, "resume"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["params"] = torch.load(os.path.join(out, "params_resume.pt"))
    return result


@pytest.mark.parametrize("family", sorted(CASES))
def test_an_interrupted_run_resumed_in_a_new_process_equals_the_whole_run(family, tmp_path):
    patch = CASES[family]
    whole = run(family, patch, str(tmp_path / "whole"), "whole")
    first = run(family, patch, str(tmp_path / "split"), "first")
    assert first["losses"] == whole["losses"][:2]
    resumed = _resume_in_a_new_process(family, patch, str(tmp_path / "split"))
    # the log carries the first steps' losses over from the checkpoint's trainer state
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=1e-6, abs=0)
    for name, expected in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()),
                                   msg=name)
    # the experts were in the Hub layout on 5.x, and the conversion restored them
    assert (resumed["restored"] > 0) == _converts()


def test_a_dense_checkpoint_needs_no_conversion_and_a_foreign_one_is_refused(tmp_path):
    dense = tiny_loss_model("llama")
    dense.save_pretrained(tmp_path / "dense")
    fresh = tiny_loss_model("llama", seed=5)
    fresh.load_state_dict(dense.state_dict())
    if not _converts():
        pytest.skip("Transformers 4.x saves checkpoints in the model's own layout: no conversion to test")
    assert restore_checkpoint_layout(fresh, str(tmp_path / "dense")) == 0  # Trainer's load was right: nothing to do
    assert restore_checkpoint_layout(fresh, str(tmp_path)) == 0  # no full-model weights here (an adapter, FSDP)

    moe = tiny_loss_model("qwen3_moe")
    moe.save_pretrained(tmp_path / "moe")
    restored = tiny_loss_model("qwen3_moe", seed=5)
    assert restore_checkpoint_layout(restored, str(tmp_path / "moe")) > 0
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in moe.state_dict().items())
    other = tiny_loss_model("qwen3_moe", seed=5, num_experts=2)  # a checkpoint of another shape
    with pytest.raises(RuntimeError, match="other weights than the saved ones"):
        restore_checkpoint_layout(other, str(tmp_path / "moe"))


def test_every_patch_turns_the_conversion_on_and_takes_it_off_with_it():
    import ac_policies

    if not _converts():
        pytest.skip("the records are skipped on Transformers 4.x")
    def live() -> set[int]:
        """Live handles per record (other tests' patched models may still await collection)."""
        return {int(row.reason.split()[0]) if row.state == "applied" else 0
                for row in model_patches.resume_conversion_status()}

    model = tiny_loss_model("llama")
    (before,) = live()
    for enable in (model_patches.enable_packing, lambda: model_patches.enable_linear_cross_entropy(model),
                   model_patches.enable_chunked_loss, model_patches.enable_trl_heads,
                   lambda: ac_policies.apply_policy(model, "full")):
        handle = enable()
        assert live() == {before + 1}
        handle.remove()
        assert live() == {before}
