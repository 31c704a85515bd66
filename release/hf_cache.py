"""Writes the Hugging Face configs vllm-ascend's tests read into a local hub cache.

The precision tests build a ``ModelConfig`` for ``Qwen/Qwen3-8B`` (and, from vllm-ascend 0.30,
its MLA test for ``deepseek-ai/DeepSeek-V2``); with ``HF_HUB_OFFLINE=1`` vLLM reads each
``config.json`` from the hub cache laid out as ``huggingface_hub`` lays it out.  The values are
the models' published architectures (only the shapes matter to attention).

    python release/hf_cache.py HUB_CACHE_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Any 40-hex string: the cache only needs refs/main to name the snapshot folder.
SNAPSHOT = "0" * 40

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1536,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 128,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 60,
    "num_key_value_heads": 128,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 16.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 3,
    "topk_method": "group_limited_greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

MODELS = {"Qwen/Qwen3-8B": QWEN3_8B, "deepseek-ai/DeepSeek-V2": DEEPSEEK_V2}


def write(hub: Path) -> None:
    for name, config in MODELS.items():
        repo = hub / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
