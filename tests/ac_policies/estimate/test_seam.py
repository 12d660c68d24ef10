"""``ac_policies.seam``: where the estimate command and a policy's handle meet other packages'
patches, imported only when they run."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from ac_policies import seam

# the package's name ``ac_policies.estimate`` is also the function ``estimate``: import the command by its path
command = importlib.import_module("ac_policies.estimate.__main__")

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize("loss", ["linear", "hidden_state", "chunked"])
def test_the_command_applies_each_loss_patch_by_name(config, capsys, loss, monkeypatch):
    handles = []
    monkeypatch.setattr(command, "apply_loss_patch", lambda model, name: handles.append(seam.apply_loss_patch(model, name)))
    try:
        assert command.main([config, "--tokens", "16", "--loss", loss, "--device", "cpu", "--dtype", "fp32"]) == 0
    finally:
        for handle in handles:
            handle.remove()
    assert [type(h).__name__ for h in handles] == ["LinearCrossEntropyHandle" if loss != "chunked" else "PatchHandle"]
    assert f"{loss} loss" in capsys.readouterr().out


def test_a_registered_loss_patch_is_offered_and_applied(config, capsys, monkeypatch):
    monkeypatch.setattr(seam, "_LOSS_PATCHES", dict(seam._LOSS_PATCHES))
    seen = []
    seam.register_loss_patch("mine", lambda model: seen.append(type(model).__name__))
    assert "mine" in seam.loss_patch_names()
    assert command.main([config, "--tokens", "16", "--loss", "mine", "--device", "cpu", "--dtype", "fp32"]) == 0
    assert seen == ["LlamaForCausalLM"]
    for taken in ("stock", "linear", "hidden_state"):
        with pytest.raises(ValueError, match="is taken"):
            seam.register_loss_patch(taken, print)
    with pytest.raises(ValueError, match="unknown loss patch 'nope'"):
        seam.apply_loss_patch(None, "nope")


def test_a_policy_without_transformers_imports_neither_it_nor_model_patches():
    code = (
        "import sys, torch, ac_policies\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).train()\n"
        "h = ac_policies.apply_policy(m, [{'match': '0', 'action': 'checkpoint'}])\n"
        "m(torch.randn(2, 4, requires_grad=True)).sum().backward(); h.remove()\n"
        "print(sorted(n for n in ('transformers', 'model_patches') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
