"""Writes the Hugging Face configs vllm-ascend's tests read into a local hub cache.

The precision tests build a ``ModelConfig`` for ``Qwen/Qwen3-8B``; with ``HF_HUB_OFFLINE=1``
vLLM reads its ``config.json`` from the hub cache laid out as ``huggingface_hub`` lays it out.
The values are Qwen3-8B's published architecture (only the shapes matter to attention).

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

MODELS = {"Qwen/Qwen3-8B": QWEN3_8B}


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
