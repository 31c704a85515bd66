"""The tiny checkpoints the real generations serve (release/generate.py, release/sglang/generate.py):
2 layers, GQA 4:2, head 64 unless asked (DeepSeek-V2: 4 heads of multi-head latent attention),
seeded weights, written by Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["checkpoint", "write", "write_tokenizer"]


def checkpoint(path: Path, arch: str, vocab: int, head_dim: int = 64) -> None:
    """A tiny ``arch`` (``llama``, ``llama_deep``: 32 layers, ``qwen3``: q/k norms, ``deepseek_v2``: MLA,
    ``deepseek_v2_wide``: MLA with DeepSeek-V3's heads and context, or ``deepseek_v3_mtp``:
    MLA and an MTP layer) in bfloat16 with its tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        write(path, DeepseekV2Config, DeepseekV2ForCausalLM, torch.bfloat16, vocab, head_dim, **MLA)
    elif arch == "deepseek_v2_wide":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        write(path, DeepseekV2Config, DeepseekV2ForCausalLM, torch.bfloat16, vocab, head_dim, **WIDE_MLA)
    elif arch == "deepseek_v3_mtp":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        write(path, DeepseekV3Config, DeepseekV3ForCausalLM, torch.bfloat16, vocab, head_dim, **MTP)
        write_mtp_layer(path)
    elif arch == "llama_deep":  # 32 layers of the tiny width: the per-layer update dominates a step
        write(path, LlamaConfig, LlamaForCausalLM, torch.bfloat16, vocab, head_dim, num_hidden_layers=DEEP_LAYERS)
    else:
        classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
        write(path, *classes, torch.bfloat16, vocab, head_dim)
    write_tokenizer(path, vocab)


DEEP_LAYERS = 32  # the side-by-side update benchmark's depth (release/update_cost.py)

# DeepSeek-V2's multi-head latent attention at its own sizes (a latent KV of 512, a rope
# part of 64: the sizes vllm-ascend's MLA kernels take), in layers of the tiny width, every
# one dense (DeepSeek-V2-Lite's: no query compression; no mixture of experts, whose kernels
# are not simulated)
MLA: dict[str, Any] = {
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 2,
    "num_key_value_heads": 4,
}

# MLA with DeepSeek-V3's attention width and context: 128 heads over the 512-wide latent
# cache, 32K tokens (vLLM's default max_model_len is the checkpoint's).  Its decode kernel's
# workspace (flash-decoding partial results: rows x heads x splits x (latent + 2) floats) is
# about 4 MiB per request at that context: the graph memory release/test_graph_memory.py needs
WIDE_MLA: dict[str, Any] = {
    **MLA,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "max_position_embeddings": 32768,
}

# DeepSeek-V3's shape (the MLA above) with one multi-token-prediction layer, which vLLM serves
# as the MTP draft (its speculative config maps deepseek_v3 to deepseek_mtp).  vLLM makes a
# layer a mixture of experts from index first_k_dense_replace on, the MTP layer included (its
# index is num_hidden_layers, 2): 3 keeps all three dense.
MTP: dict[str, Any] = {**MLA, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1}


def write(path: Path, config_cls: Any, model_cls: Any, dtype: Any, vocab: int, head_dim: int = 64, **more: Any) -> None:
    """``model_cls(config_cls(...))`` with seed 0 in ``dtype``, as safetensors at ``path`` (kept if there)."""
    if (path / "config.json").exists():
        return
    import torch

    fields: dict[str, Any] = dict(
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
    config = config_cls(**{**fields, **more})
    torch.manual_seed(0)
    model_cls(config).to(dtype).save_pretrained(path, safe_serialization=True)


def write_mtp_layer(path: Path) -> None:
    """The MTP layer of the DeepSeek-V3 at ``path``, as ``mtp.safetensors`` beside Hugging Face's
    file (which has none: transformers runs no MTP layer and writes none).

    Its weights are the names vLLM's ``DeepSeekMultiTokenPredictorLayer`` loads as layer
    ``num_hidden_layers``: a decoder layer of the model's own kind (Hugging Face's, seeded),
    the input and hidden-state norms, the projection of their concatenation (seeded), and a
    shared head whose LM head equals the model's, so vLLM shares it.  Hugging Face's own
    forward loads ``model.safetensors`` only: its reference is the model without the draft.
    """
    target = path / "mtp.safetensors"
    if target.exists():
        return
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = DeepseekV3Config.from_pretrained(path)
    n, hidden = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(1)
    layer = DeepseekV3DecoderLayer(config, layer_idx=n).to(torch.bfloat16)
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v.contiguous() for k, v in layer.state_dict().items()}
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = ones.clone()
    eh_proj = torch.empty(hidden, 2 * hidden, dtype=torch.float32).normal_(0.0, config.initializer_range)
    tensors[prefix + "eh_proj.weight"] = eh_proj.to(torch.bfloat16)
    tensors[prefix + "shared_head.head.weight"] = load_file(path / "model.safetensors")["lm_head.weight"].clone()
    save_file(tensors, target, metadata={"format": "pt"})


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
