"""One way to turn a model name into a ready model + tokenizer, loaded once per process.

Dask workers call ``load_model`` from every prefill/resume/decode task, so loads are cached
in-process (keyed by name, dtype, device) and serialized by a lock: worker threads that ask
at the same time share one load instead of each building their own copy.

The attention kernel is chosen from the dtype (``attention_for``): bf16 models must run the
position-invariant kernel so that a resumed cache is bit-exact with a full text prefill.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention import attention_for
from ..emulated_profile import is_emulated, load_profile
from .quiet import quiet_loading
from .random_llama import RANDOM_SPECS, build_random
from .smollm2 import SMOLLM2_ID, smollm2_path
from .tiny import TINY_SPECS, build_tiny

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
# Files a causal LM needs from the hub; skips duplicate .bin/.onnx/.gguf weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_LOCK = threading.RLock()


@dataclass(frozen=True, eq=False)
class LoadedModel:
    model: torch.nn.Module  # eval mode, no grads, on the requested device and dtype
    tokenizer: object  # a transformers tokenizer whose ids fit the model's vocabulary
    model_id: str  # stable name: the short name, the resolved local path, or the hub id
    path: Path  # directory the weights were loaded from

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def model_id_for(name: str) -> str:
    """The stable id a model is known by (cache keys, fingerprints, logs)."""
    if is_emulated(name) or name in TINY_SPECS or name in RANDOM_SPECS or name == SMOLLM2_ID:
        return name
    if _is_local(name):
        return str(Path(name).expanduser().resolve())
    return name  # a hub id


def resolve_model_path(name: str) -> Path:
    """The local directory holding ``name``'s weights, building/converting/fetching if needed."""
    if name in TINY_SPECS:
        with quiet_loading():
            return build_tiny(name)
    if name in RANDOM_SPECS:
        with quiet_loading():
            return build_random(name)
    if name == SMOLLM2_ID:
        return smollm2_path()
    if _is_local(name):
        return Path(name).expanduser().resolve()
    if name.count("/") != 1:
        raise ValueError(
            f"unknown model {name!r}: not one of {sorted([*TINY_SPECS, *RANDOM_SPECS, SMOLLM2_ID])}, "
            "not an existing path, not a hub id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    # No hub at run time: a hub id works once it is in the local cache (names.hub_cached).
    return Path(snapshot_download(repo_id=name, allow_patterns=_HUB_PATTERNS, local_files_only=True))


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (path / "tokenizer.json").exists():
        # The saved pipeline exactly. AutoTokenizer would pick a class from model_type
        # (e.g. Qwen2Tokenizer), which swaps in its own pre-tokenizer and normalizer: our
        # tiny Qwen2 then tokenizes differently from how it was built and breaks round-trips.
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=8)
def _load_cached(model_id: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_id)
    with quiet_loading():
        tokenizer = _load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention_for(dtype)
        )
    model.to(device).eval().requires_grad_(False)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise ValueError(f"{model_id}: tokenizer has {len(tokenizer)} tokens, model only {vocab}")
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=model_id, path=path)


def load_model(
    name_or_path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load (once per process) a named tiny or random-weight model, ``"smollm2"``, a local path or a hub id."""
    model_id = model_id_for(str(name_or_path))  # normalized, so "./m" and "/abs/m" share an entry
    if is_emulated(model_id):
        raise ValueError(f"{model_id} has no weights to load: its runner is model.emulated_runner.emulated_runner")
    with _LOCK:
        return _load_cached(model_id, as_dtype(dtype), str(torch.device(device)))


def clear_model_cache() -> None:
    """Forget loaded models (tests; freeing memory on a worker)."""
    with _LOCK:
        _load_cached.cache_clear()


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str):
    """The tokenizer alone: clients encode and decode without holding the weights (an emulated
    model's is the tokenizer of the zoo model its profile names)."""
    if is_emulated(str(name_or_path)):
        return load_tokenizer(load_profile(str(name_or_path)).tokenizer)
    path = resolve_model_path(model_id_for(str(name_or_path)))
    with quiet_loading():
        return _load_tokenizer(path)
