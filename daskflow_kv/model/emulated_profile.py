"""What an emulated engine stands in for: a model's shape and what each step of it costs.

A model name ``emulated:<profile>`` runs the real system - compiler, planner, scheduler
plugin, budget, store, transfers, step loop - over a stand-in forward pass
(``emulated_forward``) whose steps sleep the time this profile prices them at, and whose
KV blocks are real tensors of the emulated model's size. A profile is a data file in
``model/profiles/<name>.json`` that cites where its numbers come from:

* ``model``: layers, KV heads, head dim, KV dtype, position limit of the emulated model;
* ``tokenizer``: the zoo model whose tokenizer it uses (prompts count real tokens);
* ``kv_scale``: blocks hold 1/kv_scale of the emulated K/V bytes (1: all of them) - only
  where the host's memory forces it, and every output that runs it says so (``label``);
* ``step_cost``: ``policy.step_cost.StepCost`` terms (seconds per step, per prompt token,
  per query-key pair, per decode row and cached key, per join and prefix token loaded, per
  finish and token exported);
* ``token_curve`` (optional): seconds of a step's dense work by the tokens it feeds,
  ``[[tokens, seconds], ...]``, interpolated (a GPU's matmuls cost the same from 1 to ~100
  tokens, then grow linearly: one slope cannot say that); with it, ``per_prompt_token``
  and ``per_row`` must be 0;
* ``sources``: where each number came from (URL and figure, or the file of a measurement).

Torch-free: the CLI checks a name here before anything loads.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInputError
from ..policy.step_cost import StepCost

PREFIX = "emulated:"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def is_emulated(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def label_for(model) -> str | None:
    """How every output that runs ``model`` names it, if it is ``emulated:<profile>``; else None."""
    return load_profile(model).label if is_emulated(model) else None


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@dataclass(frozen=True, slots=True)
class EmulatedProfile:
    name: str  # the file's stem: ``emulated:<name>``
    emulates: str  # what it stands in for, in words (model, precision, accelerator)
    layers: int  # decoder layers of the emulated model
    kv_heads: int  # its K/V heads...
    head_dim: int  # ...of this many values each
    dtype: str  # its K/V dtype: float32 | bfloat16 | float16
    max_positions: int  # its position limit
    tokenizer: str  # the zoo model whose tokenizer it uses
    kv_scale: int  # blocks hold 1/kv_scale of the emulated K/V bytes
    cost: StepCost  # the terms a step is priced with
    token_curve: tuple[tuple[int, float], ...]  # dense work by tokens fed, seconds (empty: linear terms)
    sources: tuple  # where the numbers come from (dicts as the file has them)
    digest: str  # of the file's content: an emulated model's "weights" in its fingerprint

    @property
    def model(self) -> str:
        return PREFIX + self.name

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def emulated_bytes_per_token(self) -> int:
        """K/V bytes per token of the emulated model, all layers (before ``kv_scale``)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def stored_heads(self) -> tuple[int, int]:
        """(heads, dim) of the K/V a block stores per layer: the model's, or one head of
        1/kv_scale of its values."""
        if self.kv_scale == 1:
            return self.kv_heads, self.head_dim
        return 1, self.kv_heads * self.head_dim // self.kv_scale

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes per token the blocks really hold (what Dask stores, moves and spills)."""
        heads, dim = self.stored_heads
        return self.layers * 2 * heads * dim * self.itemsize

    @property
    def label(self) -> str:
        """How every output that ran it names it."""
        scale = "" if self.kv_scale == 1 else f", K/V scaled to 1/{self.kv_scale} of its bytes"
        return f"EMULATED {self.name} ({self.emulates}{scale})"

    def seconds(self, shape: dict) -> float:
        """What a step of ``shape`` (a ``StepShape.as_dict()``) costs."""
        s = self.cost.seconds(shape)
        if self.token_curve:
            s += _interpolate(self.token_curve, shape.get("prompt_tokens", 0) + shape.get("decode_rows", 0))
        return s

    def describe(self) -> dict:
        """What a result records of the profile it ran."""
        return {"label": self.label, "profile": self.name, "emulates": self.emulates, "kv_scale": self.kv_scale,
                "bytes_per_token": self.bytes_per_token, "emulated_bytes_per_token": self.emulated_bytes_per_token,
                "digest": self.digest, "sources": list(self.sources)}


def _interpolate(curve, tokens: int) -> float:
    """Piecewise linear through ``curve``; below its first point, its first value (a step costs
    at least what one token does); past its last, its last slope; 0 tokens cost nothing."""
    if tokens <= 0:
        return 0.0
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = curve[-2], curve[-1]
    return y1 + (y1 - y0) * (tokens - x1) / (x1 - x0)


def parse(name: str, data: dict, digest: str = "") -> EmulatedProfile:
    """A profile from its file's content, every field checked (one line naming the bad one)."""
    def need(d, key, kind, where):
        v = d.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise InvalidInputError(f"emulated profile {name}: {where}{key} must be {kind.__name__}, got {v!r}")
        return v

    m = need(data, "model", dict, "")
    ints = {k: need(m, k, int, "model.") for k in ("layers", "kv_heads", "head_dim", "max_positions")}
    if min(ints.values()) < 1:
        raise InvalidInputError(f"emulated profile {name}: model sizes must be >= 1, got {ints}")
    dtype = need(m, "dtype", str, "model.")
    if dtype not in _ITEMSIZE:
        raise InvalidInputError(f"emulated profile {name}: model.dtype must be one of {sorted(_ITEMSIZE)}")
    scale = data.get("kv_scale", 1)
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1 or \
            (ints["kv_heads"] * ints["head_dim"]) % scale or \
            (ints["kv_heads"] * ints["head_dim"] // scale) * _ITEMSIZE[dtype] % 8:
        raise InvalidInputError(f"emulated profile {name}: kv_scale must divide kv_heads x head_dim and leave at "
                                f"least 8 bytes a token and layer, in whole 4-byte words; got {scale!r}")
    terms = need(data, "step_cost", dict, "")
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 for v in terms.values()):
        raise InvalidInputError(f"emulated profile {name}: step_cost terms must be numbers >= 0")
    cost = StepCost.from_dict(terms)
    curve = tuple((int(x), float(y)) for x, y in data.get("token_curve") or ())
    if curve and (len(curve) < 2 or any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(curve, curve[1:]))
                  or curve[0][0] < 1 or cost.per_prompt_token or cost.per_row):
        raise InvalidInputError(f"emulated profile {name}: token_curve needs >= 2 points, tokens rising from >= 1 "
                                "and seconds not falling, and per_prompt_token = per_row = 0 beside it")
    sources = data.get("sources")
    if not isinstance(sources, list) or not sources:
        raise InvalidInputError(f"emulated profile {name}: sources must name where its numbers come from")
    return EmulatedProfile(name, need(data, "emulates", str, ""), ints["layers"], ints["kv_heads"], ints["head_dim"],
                           dtype, ints["max_positions"], need(data, "tokenizer", str, ""), scale, cost, curve,
                           tuple(sources), digest)


@functools.lru_cache(maxsize=16)
def load_profile(model: str) -> EmulatedProfile:
    """The profile of ``emulated:<name>`` (or of ``<name>``), read from ``model/profiles``."""
    name = model[len(PREFIX):] if is_emulated(model) else model
    path = PROFILE_DIR / f"{name}.json"
    if not name or "/" in name or name.startswith(".") or not path.is_file():
        raise InvalidInputError(f"no emulated profile {name!r}; known: {', '.join(profile_names())}")
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise InvalidInputError(f"emulated profile {name}: not JSON ({e})") from None
    return parse(name, data, hashlib.blake2b(raw, digest_size=12).hexdigest())
