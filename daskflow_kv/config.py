"""Settings under ``dask.config["daskflow-kv"]``, registered the way distributed and dask-cuda do.

The defaults ship in ``daskflow-kv.yaml`` beside this module and are merged *under*
whatever Dask already collected, so a user's YAML in ``~/.config/dask/``, environment
variables (``DASK_DASKFLOW_KV__KV_BUDGET=2GiB``) and ``dask.config.set`` all win over them.
Keyword arguments and CLI flags win over config: callers pass their value to ``get`` and
get the configured one only when they passed None.
"""

from __future__ import annotations

from pathlib import Path

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from .errors import InvalidInputError

NAMESPACE = "daskflow-kv"
DEFAULTS_FILE = Path(__file__).with_name("daskflow-kv.yaml")

with open(DEFAULTS_FILE) as f:
    defaults = yaml.safe_load(f)
dask.config.update_defaults(defaults)


def get(key: str, override=None):
    """``override`` when given, else ``daskflow-kv.<key>`` from dask.config."""
    return override if override is not None else dask.config.get(f"{NAMESPACE}.{key}")


def get_bytes(key: str, override=None) -> int | None:
    """A byte size (``"512MiB"``, ``2e9``, ``None``) as an int, or None when unset."""
    value = get(key, override)
    try:
        return None if value is None else parse_bytes(value)
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidInputError(f"daskflow-kv.{key}: {value!r} is not a byte size (e.g. 512MiB)") from e


def get_seconds(key: str, override=None) -> float:
    """A duration (``"200ms"``, ``2``) in seconds; a bad one is one line naming the setting."""
    value = get(key, override)
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidInputError(f"daskflow-kv.{key}: {value!r} is not a duration (e.g. 500ms, 2s)") from e
    if seconds is None or seconds < 0:
        raise InvalidInputError(f"daskflow-kv.{key}: {value!r} is not a duration (e.g. 500ms, 2s)")
    return seconds
