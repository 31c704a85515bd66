"""The tiny checkpoints the real generations serve (release/generate.py, release/sglang/generate.py):
2 layers, GQA 4:2, head 64 unless asked, seeded weights, written by Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["checkpoint", "write", "write_tokenizer"]


def checkpoint(path: Path, arch: str, vocab: int, head_dim: int = 64) -> None:
    """A tiny ``arch`` (``llama`` or ``qwen3``: q/k norms) in bfloat16 with its tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    write(path, *classes, torch.bfloat16, vocab, head_dim)
    write_tokenizer(path, vocab)


def write(path: Path, config_cls: Any, model_cls: Any, dtype: Any, vocab: int, head_dim: int = 64) -> None:
    """``model_cls(config_cls(...))`` with seed 0 in ``dtype``, as safetensors at ``path`` (kept if there)."""
    if (path / "config.json").exists():
        return
    import torch

    config = config_cls(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.08,  # decisive logits: greedy choices are not near-ties
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model_cls(config).to(dtype).save_pretrained(path, safe_serialization=True)


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer for the checkpoint at ``path``: token ``i`` is the word ``t<i>``
    (1 bos, 2 eos), so an engine loads it as it loads any model's, with no option to skip it."""
    if (path / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0"
    )
    fast.save_pretrained(path)
