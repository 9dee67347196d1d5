"""Every input check in one place: arguments, CLI flags and settings, before expensive work.

Each check is a small function ``check(name, value, ...)`` that returns the value in its
normal form (an ``int``, a byte count, a canonical dtype name) or raises
``InvalidInputError`` with one line: the input's name, what it must be, what it got. Entry
points (the CLI, ``Engine``, ``KVRuntime``, ``Workflow``) call them first, so a bad value
fails in milliseconds, before a cluster starts, a model loads, a block is acquired or a task
is submitted: nothing is left half done and the runtime stays usable.

Imports only ``errors``, ``config`` and ``plain_checks`` (the checks that need nothing but
Python, which ``policy/`` uses without Dask), so every layer may use it. Two checks look outside
the process, with the standard library only: ``writable_file``/``writable_dir`` (the file
system) and ``scheduler_reachable`` (one TCP connect). Whether a *state* fits a model stays
in ``state.compat``.
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import socket
from collections.abc import Callable, Collection
from pathlib import Path
from typing import NoReturn

from dask.utils import parse_bytes, parse_timedelta

from . import config
from .errors import InvalidInputError
from .plain_checks import choice, fail, integer, number, optional, show_value  # noqa: F401 -- re-exported

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # accepted spelling -> canonical name
SCHEMES = ("tcp", "tls", "ucx", "ucxx", "ws", "wss", "inproc")  # Dask comm protocols
_SOCKET_SCHEMES = ("tcp", "tls", "ws", "wss")  # reachable by a plain TCP connect
_DEFAULT_PORT = 8786  # Dask's, when an address names none


def byte_size(name: str, value, minimum: int = 1) -> int:
    """A byte count: an int or a string like ``512MiB`` / ``2GB`` / ``1e9``."""
    must = {0: "a byte size such as 512MiB or 2GB", 1: "a positive byte size such as 512MiB or 2GB"}.get(
        minimum, f"a byte size such as 512MiB or 2GB, at least {minimum} bytes")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        fail(name, must, value)
    try:
        v = int(parse_bytes(value))
    except (TypeError, ValueError, OverflowError):
        fail(name, must, value)
    if v < minimum:
        fail(name, must, value)
    return v


def duration(name: str, value) -> float:
    """Seconds > 0, from a number or a string like ``200ms`` / ``3s``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        fail(name, "a duration such as 3s or 200ms", value)
    try:
        v = float(parse_timedelta(value, default="seconds"))
    except (TypeError, ValueError, KeyError):
        fail(name, "a duration such as 3s or 200ms", value)
    if not math.isfinite(v) or v <= 0:
        fail(name, "a duration such as 3s or 200ms (> 0)", value)
    return v


def setting(key: str, override, name: str, check: Callable, *args, **kwargs):
    """``check`` on ``override``, or on the configured ``daskflow-kv.<key>`` when it is None.

    A configured value is named by its setting, so a bad ``DASK_DASKFLOW_KV__...`` variable
    or YAML entry is reported as such rather than as the flag the user never passed.
    """
    if override is not None:
        return check(name, override, *args, **kwargs)
    return check(f"setting daskflow-kv.{key}", config.get(key), *args, **kwargs)


# -- model-facing values ------------------------------------------------------------------------
def dtype(name: str, value) -> str:
    """``float32`` | ``bfloat16`` | ``float16`` (``fp32``, ``torch.bfloat16``... accepted)."""
    key = str(value).removeprefix("torch.") if not isinstance(value, (bool, int, float)) else None
    if key not in DTYPES:
        fail(name, "one of float32, bfloat16, float16", value)
    return DTYPES[key]


def block_size(name: str, value) -> int:
    return integer(name, value, minimum=1)


def auto_or_count(name: str, value) -> str | int:
    """``"auto"`` (daskflow-kv chooses) or an integer >= 1: the workers one prefill is split
    over (``parallelism``), a worker's torch threads (``cluster.torch-threads``)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(name, '"auto" or an integer >= 1', value)
    return value


parallelism = auto_or_count  # workers one prefill is split over


def max_new_tokens(name: str, value) -> int:
    """Tokens to generate: an integer >= 1 (use extend to prefill without generating)."""
    return integer(name, value, minimum=1)


def fork_count(name: str, k) -> int:
    """Branches of one fork: 1 .. ``daskflow-kv.max-fork`` (daskflow-kv.yaml says why)."""
    k = integer(name, k, minimum=1)
    limit = integer("setting daskflow-kv.max-fork", config.get("max-fork"), minimum=1)
    if k > limit:
        raise InvalidInputError(f"{name} must be at most {limit} (setting daskflow-kv.max-fork), got {k}; "
                                "fork in stages (forks of forks) or raise the setting")
    return k


def token_ids(name: str, tokens, vocab_size: int | None = None, allow_empty: bool = True) -> list[int]:
    """A sequence of integer token ids inside ``[0, vocab_size)``, as a list of ints.

    Strings are refused (``'39'`` would pass a range check after ``int()`` and fail later,
    on a worker): pass text to the operators that take text, ids everywhere else.
    """
    if isinstance(tokens, (str, bytes)):
        raise InvalidInputError(f"{name} must be a sequence of token ids, got text {show_value(tokens)}; "
                                "encode it first (encode(text))")
    try:
        items = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # arrays, tensors
    except TypeError:
        fail(name, "a sequence of token ids (ints)", tokens)
    if not isinstance(items, list):  # a 0-d array's tolist() is a scalar
        fail(name, "a sequence of token ids (ints)", tokens)
    out = []
    for i, t in enumerate(items):
        if isinstance(t, (bool, str, bytes)) or not hasattr(type(t), "__index__"):
            raise InvalidInputError(f"{name} must be integer token ids, got {show_value(t)} "
                                    f"({type(t).__name__}) at position {i}")
        out.append(operator.index(t))
    if not out and not allow_empty:
        raise InvalidInputError(f"{name} must hold at least one token, got none")
    if vocab_size is not None:
        bad = [t for t in out if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInputError(f"{name}: token ids {bad[:5]} are outside the model's vocabulary of {vocab_size}")
    return out


def instance(name: str, value, cls: type | tuple[type, ...]):
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise InvalidInputError(f"{name} must be a {names}, got {type(value).__name__} {show_value(value)}")
    return value


def pairs(name: str, items, what: str = "(state, suffix)") -> list[tuple]:
    """A sequence of 2-item pairs, as a list of tuples."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        fail(name, f"a list of {what} pairs", items)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            fail(f"{name}[{i}]", f"a {what} pair", item)
        out.append(tuple(item))
    return out


def distinct_states(op: str, a_id: str, b_id: str) -> None:
    """Two operands that must be different states (merging a state with itself adds nothing)."""
    if a_id == b_id:
        raise InvalidInputError(f"{op} needs two different states, got {a_id} twice")


def model_source(name: str, value, known: Collection[str], cached: Callable[[str], bool] | None = None) -> str:
    """A model the zoo knows, a local directory holding a saved model, or a hub id already cached.

    Nothing is downloaded at run time, so anything else fails here, naming the choices.
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        fail(name, f"a model name ({', '.join(known)}) or a model directory", value)
    text = str(value)
    if text in known:
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidInputError(f"{name} {text!r} is a directory without config.json, not a saved model")
        return text
    if path.exists():
        raise InvalidInputError(f"{name} {text!r} is a file; give the directory of a saved model (with config.json)")
    if cached is not None and cached(text):
        return text
    raise InvalidInputError(
        f"{name} {text!r} is not a known model ({', '.join(known)}) nor an existing model directory "
        "(no model hub is contacted at run time)"
    )


# -- files and addresses ------------------------------------------------------------------------
def writable_file(name: str, path) -> str:
    """A file path that can be created or overwritten (its directory exists and is writable)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        fail(name, "a file path", path)
    p = Path(path).expanduser()
    if p.is_dir():
        raise InvalidInputError(f"{name} {str(path)!r} is a directory, not a file")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise InvalidInputError(f"{name} {str(path)!r}: directory {str(parent)!r} does not exist")
    ok = os.access(p, os.W_OK) if p.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not ok:
        raise InvalidInputError(f"{name} {str(path)!r} is not writable")
    return str(p)


def readable_file(name: str, path) -> str:
    """An existing, readable file (a certificate, a key)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        fail(name, "a file path", path)
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInputError(f"{name} {str(path)!r} is not an existing file")
    if not os.access(p, os.R_OK):
        raise InvalidInputError(f"{name} {str(path)!r} is not readable")
    return str(p)


def writable_dir(name: str, path) -> Path:
    """A directory that exists and is writable, or can be created under a writable one."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        fail(name, "a directory path", path)
    p = Path(path).expanduser().absolute()
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise InvalidInputError(f"{name} {str(path)!r}: {str(probe)!r} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{name} {str(path)!r} is not writable")
    return p


STORE_WRITES = ("all", "materialize-only", "off")  # which new KV blocks are written to the store


def store_url(name: str, value) -> str:
    """A persistent KV store: a directory (created if needed) or a URL fsspec can open
    (``file://``, ``s3://``, ``gs://``, ``memory://``...). Remote ones are not contacted here."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        fail(name, "a directory or an fsspec URL such as file:///data/kv or s3://bucket/kv", value)
    url = str(value).strip()
    if "://" not in url:
        writable_dir(name, url)
        return str(Path(url).expanduser().absolute())
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        writable_dir(name, rest or "/")
        return url
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise InvalidInputError(f"{name} {url!r}: unknown storage protocol {scheme!r} "
                                f"(fsspec knows file, s3, gs, memory, ...)")
    return url


def scheduler_address(name: str, value) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``tcp://host:port``, ``host:port``, ``tls://[::1]:8786``..."""
    must = "a scheduler address such as tcp://host:8786"
    if not isinstance(value, str) or not value.strip():
        fail(name, must, value)
    scheme, sep, rest = value.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", value.strip()
    if scheme not in SCHEMES or not rest:
        fail(name, must, value)
    if scheme == "inproc":
        return scheme, rest, 0
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        port_text = tail.removeprefix(":") if tail.startswith(":") else ("" if not tail else None)
    else:
        host, _, port_text = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not host or port_text is None or "/" in host:
        fail(name, must, value)
    if not port_text:
        return scheme, host, _DEFAULT_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        fail(name, must + " (port 1-65535)", value)
    return scheme, host, int(port_text)


def scheduler_reachable(name: str, address, timeout: float | None = None) -> str:
    """Fail fast, with what to check, when nothing listens at a scheduler address.

    One TCP connect with a short timeout (``daskflow-kv.connect-timeout``): a refused
    connection fails in milliseconds, where a Dask client would keep retrying for its
    whole connect timeout. Protocols without a plain socket (ucx, inproc) are not probed.
    """
    scheme, host, port = scheduler_address(name, address)
    if scheme not in _SOCKET_SCHEMES:
        return address
    timeout = duration("setting daskflow-kv.connect-timeout", config.get("connect-timeout")) \
        if timeout is None else timeout
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        why = "connection refused"
    except socket.gaierror:
        why = f"unknown host {host!r}"
    except (TimeoutError, socket.timeout):
        why = f"no answer within {timeout:g}s"
    except OSError as e:
        why = e.strerror or type(e).__name__
    else:
        return address
    raise InvalidInputError(
        f"{name} {address}: cannot reach a scheduler ({why}); check that `dask scheduler` is running there "
        "and that the host, port and firewall allow the connection"
    )


# -- command lines ------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse, reporting a bad flag in one line (no usage block) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
