"""Random-weight causal LMs with the shapes of a real checkpoint, built offline.

``llama-3.2-1b-random`` is Llama-3.2-1B's published configuration (16 layers, hidden 2048,
32 query heads sharing 8 KV heads of 64, MLP 8192, vocabulary 128,256, tied embeddings,
RoPE theta 5e5 with llama3 scaling) with seeded random weights: 1.24 B parameters and
32 KiB of bf16 KV per token, so prefill, decode and KV transfer cost what the real model's
do; it knows nothing, and its outputs are noise. No hub is reached: the config is written
here and the weights are drawn locally.

``llama-3.2-1b-mini`` has the same structure (GQA 4:1, 64-dim heads, tied embeddings,
llama3 RoPE) at a width a CPU test builds in a second; it checks the recipe without GPUs.

The tokenizer is the tiny models' byte-level BPE (384 tokens), so prompts encode offline.
The model's vocabulary is far larger: ids the tokenizer does not know decode to nothing,
which is harmless here, since exactness compares token ids, never text.

Builds are cached like the tiny models (``model_cache_dir()``, atomic publish). Weights are
saved in ``dtype`` (bf16 for the 1B: 2.5 GB) and drawn on ``device`` (CUDA when there is one:
seconds instead of minutes); the marker file records both.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .cache_dir import model_cache_dir
from .tiny import train_tokenizer

BUILDER_VERSION = 1  # bump when the recipe changes, so stale caches are rebuilt

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}

# Llama-3.2-1B's config.json, as published (the numbers that decide shapes and cost).
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters=_LLAMA3_ROPE,
)

RANDOM_SPECS = {
    "llama-3.2-1b-random": dict(config=LLAMA_3_2_1B, seed=3211, dtype="bfloat16"),
    "llama-3.2-1b-mini": dict(
        config={**LLAMA_3_2_1B, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 4096},
        seed=3212,
        dtype="float32",
    ),
}
# A wide init makes logits peaked, so greedy decoding of a random model is not decided by
# near-ties that rounding could flip (the tiny models do the same).
INIT_STD = 0.25


def random_model_names() -> list[str]:
    return sorted(RANDOM_SPECS)


def random_config(name: str, tokenizer=None):
    """The transformers LlamaConfig of ``name`` (token ids from ``tokenizer`` when given)."""
    from transformers import LlamaConfig

    spec = RANDOM_SPECS[name]
    ids = {}
    if tokenizer is not None:
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(initializer_range=INIT_STD, **spec["config"], **ids)


def parameter_count(config) -> int:
    """Parameters of a Llama with this config (tied embeddings counted once), without building it."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # q, k, v, o, gate/up/down, two norms
    embed = config.vocab_size * h
    return n * per_layer + embed * (1 if config.tie_word_embeddings else 2) + h  # + final norm


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_random(name: str, root: str | os.PathLike | None = None, device: str | None = None) -> Path:
    """Build (once) and return the directory of random-weight model ``name``."""
    import torch
    from transformers import AutoModelForCausalLM

    if name not in RANDOM_SPECS:
        raise KeyError(f"unknown random model {name!r}; known: {', '.join(random_model_names())}")
    path = Path(root or model_cache_dir()) / f"{name}-v{BUILDER_VERSION}"
    marker = path / "daskflow_kv.json"
    if marker.exists():
        return path
    spec = RANDOM_SPECS[name]
    device = device or _default_device()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    cfg = random_config(name)
    tokenizer = train_tokenizer(tmp, cfg.max_position_embeddings)
    cfg = random_config(name, tokenizer)
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, spec["dtype"]))
    model.save_pretrained(tmp)
    info = {"name": name, "version": BUILDER_VERSION, "weights": "random", "seed": spec["seed"], "init_std": INIT_STD,
            "drawn_on": device, "dtype": spec["dtype"], "parameters": sum(p.numel() for p in model.parameters())}
    del model
    (tmp / "daskflow_kv.json").write_text(json.dumps(info))
    try:
        tmp.rename(path)  # atomic publish: concurrent builders never see half a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path
