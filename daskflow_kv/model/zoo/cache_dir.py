"""Where built and converted models live: a user cache, never the repository."""

from __future__ import annotations

import os
from pathlib import Path


def model_cache_dir() -> Path:
    """``$DASKFLOW_KV_CACHE`` or ``$XDG_CACHE_HOME/daskflow-kv`` (default ``~/.cache``)."""
    root = os.environ.get("DASKFLOW_KV_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(xdg, "daskflow-kv")
    path = Path(root) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
