"""Token batches for the tiny models of :mod:`tests.support.tiny_models`, and the gradients one
training step leaves on a model."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.tiny_models import AC_REACH_FAMILIES, LOSS_VOCAB


def padded_batch(seed: int = 0, b: int = 2, t: int = 12) -> dict[str, torch.Tensor]:
    """Right-padded rows: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, LOSS_VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, t - 4:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[0, :2] = -100  # a prompt without loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(doc_lengths: tuple[int, ...] = (5, 7, 4), seed: int = 1) -> dict[str, torch.Tensor]:
    """One packed row: per-document ``position_ids`` and ``shift_labels`` that never cross a document."""
    g = torch.Generator().manual_seed(seed)
    t = sum(doc_lengths)
    ids = torch.randint(0, LOSS_VOCAB, (1, t), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths]).unsqueeze(0)
    shift = torch.full((1, t), -100)
    start = 0
    for n in doc_lengths:
        shift[0, start:start + n - 1] = ids[0, start + 1:start + n]
        start += n
    return {"input_ids": ids, "position_ids": position_ids, "shift_labels": shift}


def token_batch(seed: int = 0, b: int = 2, s: int = 12, vocab: int = 128) -> torch.Tensor:
    """``[b, s]`` random token ids in ``[2, vocab)`` (the checkpointing models' vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (b, s), generator=g)


def image_batch(seed: int = 0, text: int = 6) -> dict[str, torch.Tensor]:
    """Inputs for the tiny Qwen3-VL-MoE: one 8x8-patch image (16 patches -> 4 tokens) inside text."""
    g = torch.Generator().manual_seed(seed)
    cfg = AC_REACH_FAMILIES["qwen3_vl_moe"]
    patch = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
    ids = torch.randint(2, 120, (1, text), generator=g)
    image = torch.tensor([[cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * 4 + [cfg["vision_end_token_id"]]])
    input_ids = torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1)
    return {
        "input_ids": input_ids,
        "labels": input_ids,
        "mm_token_type_ids": (input_ids == cfg["image_token_id"]).int(),  # 1: image, 0: text
        "pixel_values": torch.randn(16, patch, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (copied), then the model's gradients cleared."""
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def step_loss_and_grads(model: torch.nn.Module,
                        inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward of ``model(**inputs)`` from cleared gradients and a fixed seed (1234,
    for dropout); returns the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor,
                   **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`step_loss_and_grads` with ``labels = input_ids = ids``."""
    return step_loss_and_grads(model, dict(input_ids=ids, labels=ids, **kwargs))


def assert_same_gradients(got: dict, want: dict, what: str, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    """The same parameters got gradients, each equal to ``want``'s within ``rtol``/``atol``."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{what}/{name}: {m}")
