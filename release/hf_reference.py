"""Hugging Face's float32 forward as the reference of a real generation's greedy tokens
(release/test_generate.py, release/sglang/test_generate.py): it runs none of npugraph's code."""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_forks_are_near_ties", "check_greedy_choices", "greedy_choices"]


def greedy_choices(
    model_dir: Path | str, prompts: list[list[int]], generations: list[list[int]]
) -> list[tuple[float, int]]:
    """Per request, teacher-forced through the checkpoint in float32: how far its worst token's
    logit is below the best one at that step, and how many of its tokens are the argmax.

    A text served more than once (a soak repeats its prompts, and greedy serving mostly gives
    the same text again) is forwarded once: the same tokens give the same answer."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: dict[tuple[int, ...], tuple[float, int]] = {}
    out = []
    for prompt, tokens in zip(prompts, generations):
        key = (len(prompt), *prompt, *tokens)  # where the prompt ends is part of the question
        if key not in seen:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
            chosen = logits.gather(1, torch.tensor(tokens).view(-1, 1)).view(-1)
            gap = float((logits.max(-1).values - chosen).max())
            seen[key] = (gap, int((logits.argmax(-1) == torch.tensor(tokens)).sum()))
        out.append(seen[key])
    return out


def check_greedy_choices(
    model_dir: Path | str,
    prompts: list[list[int]],
    generations: list[list[int]],
    tolerance: float,
    exact_share: float = 0.9,
) -> None:
    """Raise ``AssertionError`` unless every generated token's logit is within ``tolerance``
    of the best one (Hugging Face's float32 forward, :func:`greedy_choices`) and at least
    ``exact_share`` of them are its argmax (the rest: near-ties the engine's dtype may break
    either way).  Raised, not asserted: ``python -O`` would drop an assert, and the check pass."""
    choices = greedy_choices(model_dir, prompts, generations)
    for prompt, (gap, _) in zip(prompts, choices):
        if gap > tolerance:
            raise AssertionError(f"prompt {prompt[:4]}...: a token {gap:.3f} below the best")
    exact, total = sum(n for _, n in choices), sum(len(t) for t in generations)
    if exact < exact_share * total:
        raise AssertionError(f"{exact} of {total} tokens are Hugging Face's argmax, fewer than {exact_share:.0%}")


def check_forks_are_near_ties(
    model_dir: Path | str, prompts: list[list[int]], mine: list[list[int]], theirs: list[list[int]], near: float
) -> int:
    """Where a request's tokens first differ between two generations (``mine``, ``theirs``),
    both tokens must be within ``near`` of Hugging Face's best there (a near-tie that another
    order of the same sums may break the other way); raise ``AssertionError`` otherwise.
    Returns how many requests forked."""
    forks = []
    for prompt, a, b in zip(prompts, mine, theirs):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:
            forks.append((prompt, a[: at + 1], b[: at + 1]))
    if not forks:
        return 0
    gaps = greedy_choices(model_dir, [p for p, _, _ in forks for _ in (0, 1)], [t for _, a, b in forks for t in (a, b)])
    worst = max(gap for gap, _ in gaps)
    if worst > near:
        raise AssertionError(f"{len(forks)} requests fork; a forking token is {worst:.3f} below the best (> {near})")
    return len(forks)
