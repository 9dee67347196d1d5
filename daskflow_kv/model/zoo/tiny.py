"""Tiny, seeded, random-init causal LMs built offline, for tests and quick runs.

Each tiny model is a real transformers architecture (Llama with grouped-query attention,
Qwen2 with attention biases, Mistral with a sliding window on every layer, Gemma 3 with
sliding and full attention layers alternating, Llama 4 with chunked attention) with a locally trained byte-level BPE tokenizer, saved with
``save_pretrained`` and reloaded with ``from_pretrained`` like any hub model. Builds are
cached on disk, keyed by name and builder version, so tests do not rebuild them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .cache_dir import model_cache_dir

BUILDER_VERSION = 4  # bump when the recipe changes, so stale caches are rebuilt
VOCAB_SIZE = 384

# Enough varied English for a byte-level BPE to learn common merges; the exact text only
# matters for reproducibility, so it is fixed here rather than read from disk.
_CORPUS = """
The shared context is prefilled once and every agent resumes from the same key value cache.
Agents debate, plan, retrieve and judge; each one reads what the others wrote.
A tree of thought expands several branches from one prompt and keeps the best of them.
Retrieval augmented generation places passages before the question so the model can cite them.
The planner splits the task, the solvers answer the parts, the judge merges their answers.
Workers hold blocks of tensors in memory and the scheduler moves them when moving is cheaper.
Numbers like 1 2 3 10 42 128 4096 and symbols such as ( ) [ ] { } : ; , . ! ? - + * / = appear too.
"""

TINY_SPECS = {
    # Llama with grouped-query attention: 4 query heads share 2 KV heads.
    "tiny-llama": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        seed=1234,
    ),
    # Qwen2: a second family, with q/k/v biases and a different rope base.
    "tiny-qwen2": dict(
        arch="qwen2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        seed=4321,
    ),
    # Mistral: every layer attends to the last 24 tokens only (a window shorter than the
    # test contexts, so resumed caches really hold keys the window must hide).
    "tiny-mistral": dict(
        arch="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=24,
        seed=2718,
    ),
    # Gemma 3: sliding (16 tokens) and full attention layers alternate, with per-layer-type
    # masks and rope bases, QK-norm and a scaled embedding.
    "tiny-gemma3": dict(
        arch="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=2048,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        seed=3141,
    ),
    # Llama 4 text: chunked attention (each token sees only its own 16-token chunk), an
    # attention pattern batched resume does not reproduce, so the runtime resumes its
    # branches one by one; a single expert keeps it tiny.
    "tiny-llama4": dict(
        arch="llama4_text",
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=1,
        num_experts_per_tok=1,
        attention_chunk_size=16,
        max_position_embeddings=2048,
        seed=1618,
    ),
}


def tiny_model_names() -> list[str]:
    return sorted(TINY_SPECS)


def train_tokenizer(path: Path, max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>", "<|endoftext|>"],  # Qwen2 tokenizers expect the last
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=max_length,
    )
    fast.save_pretrained(path)
    return fast


def _config(spec: dict, tokenizer):
    from transformers import Gemma3TextConfig, LlamaConfig, Llama4TextConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma3_text": Gemma3TextConfig,
           "llama4_text": Llama4TextConfig}[spec["arch"]]
    kwargs = {k: v for k, v in spec.items() if k not in ("arch", "seed")}
    return cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # A wide init makes logits peaked, so greedy decoding of a random model is not
        # decided by near-ties that rounding could flip (bf16 tests depend on it).
        initializer_range=0.25,
        **kwargs,
    )


def build_tiny(name: str, root: str | os.PathLike | None = None) -> Path:
    """Build (once) and return the directory of tiny model ``name``."""
    import torch
    from transformers import AutoModelForCausalLM

    if name not in TINY_SPECS:
        raise KeyError(f"unknown tiny model {name!r}; known: {', '.join(tiny_model_names())}")
    path = Path(root or model_cache_dir()) / f"{name}-v{BUILDER_VERSION}"
    marker = path / "daskflow_kv.json"
    if marker.exists():
        return path
    spec = TINY_SPECS[name]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tokenizer = train_tokenizer(tmp, spec["max_position_embeddings"])
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(_config(spec, tokenizer), dtype=torch.float32)
    model.save_pretrained(tmp)
    (tmp / "daskflow_kv.json").write_text(json.dumps({"name": name, "version": BUILDER_VERSION}))
    try:
        tmp.rename(path)  # atomic publish: concurrent builders never see half a model
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path
