"""What a KV state is only valid for: model weights, config, tokenizer, dtype, rope, tenant.

Two states may share or exchange blocks only when their fingerprints are equal. The weights
digest samples every parameter (name, shape and a strided slice of its bytes) so that two
checkpoints of one architecture - same config, other weights - are told apart without
hashing gigabytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace

import torch

# Config keys that do not change what a forward pass computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
    "architectures",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")
_SAMPLE_BYTES = 4096  # per parameter; enough to tell two random inits or checkpoints apart


def _digest(payload: str | bytes) -> str:
    data = payload.encode() if isinstance(payload, str) else payload
    return hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model_id: str  # the name or path the model was loaded from (for humans and errors)
    weights: str  # sampled digest of all parameters
    config: str  # digest of the model config, volatile keys removed
    tokenizer: str  # digest of the tokenizer's full serialized form
    dtype: str  # KV dtype, e.g. "bfloat16"
    rope: str  # positional encoding settings, verbatim (short, and readable in errors)
    namespace: str = ""  # tenants share blocks only inside one namespace

    @property
    def digest(self) -> str:
        """One string that changes when any field changes; seeds every block key."""
        return _digest("|".join(getattr(self, f.name) for f in fields(self)))

    def differences(self, other: "Fingerprint") -> list[str]:
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def with_namespace(self, namespace: str) -> "Fingerprint":
        return replace(self, namespace=namespace)


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=12)
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // (_SAMPLE_BYTES // max(1, flat.element_size())))
        sample = flat[::step].contiguous().cpu()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _config_digest(config) -> tuple[str, str]:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    rope = {k: d.get(k) for k in _ROPE_KEYS if d.get(k) is not None}
    return _digest(json.dumps(d, sort_keys=True, default=str)), json.dumps(rope, sort_keys=True, default=str)


def tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps(sorted(map(str, tokenizer.all_special_tokens)))
    return _digest(body + special)


def fingerprint_model(model, tokenizer, model_id: str, namespace: str = "") -> Fingerprint:
    config_digest, rope = _config_digest(model.config)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Fingerprint(
        model_id=model_id,
        weights=_weights_digest(model),
        config=config_digest,
        tokenizer=tokenizer_digest(tokenizer),
        dtype=dtype,
        rope=rope,
        namespace=namespace,
    )
