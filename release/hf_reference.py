"""Hugging Face's float32 forward as the reference of a real generation's greedy tokens
(release/test_generate.py, release/sglang/test_generate.py): it runs none of npugraph's code."""

from __future__ import annotations

from pathlib import Path

__all__ = ["greedy_choices"]


def greedy_choices(
    model_dir: Path | str, prompts: list[list[int]], generations: list[list[int]]
) -> list[tuple[float, int]]:
    """Per request, teacher-forced through the checkpoint in float32: how far its worst token's
    logit is below the best one at that step, and how many of its tokens are the argmax."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, tokens in zip(prompts, generations):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        chosen = logits.gather(1, torch.tensor(tokens).view(-1, 1)).view(-1)
        gap = float((logits.max(-1).values - chosen).max())
        out.append((gap, int((logits.argmax(-1) == torch.tensor(tokens)).sum())))
    return out
