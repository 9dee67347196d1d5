"""The ``kv`` annotation of a KV task, checked and typed before the plugin acts on it.

A client writes the annotation (``runtime/submit.py``); the plugin trusts nothing in it
but what it checks here: types, signs and bounds of every number (a negative ``kv_out``
would lower a worker's reserved bytes and switch its budget off), the size of every list,
and that a block's entry names the task's own key (a task may publish only the block it
computes). Numbers are compared as they came, never converted first: ``10**400`` is an
int that no float holds (``math.isfinite`` raises on it), and a check that raises
something else than its one-line ``ValueError`` must still refuse. A note that fails
raises ``ValueError`` with one line saying which field and why; the plugin refuses the
task with it, and with any other exception too (``kv_ownership``: it fails closed).

Two roles: ``compute`` (a prefill, batch, chunk or store load: placement, admission,
queue, decision) and ``block`` (the catalog entry of the block the task makes).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

from daskflow_kv.keys import is_block, short_key, tag_of

MAX_BYTES = 1 << 50  # KV bytes one task may claim (1 PiB: more is a forged number)
MAX_SECONDS = 1e7  # predicted seconds of one task
MAX_TOKENS = 1 << 24  # token positions of one block
MAX_LIST = 1 << 16  # entries of a note's lists (reads, tokens, branches)
MAX_TEXT = 256  # characters of a note's strings
MAX_GANG = 1024  # tasks in one gang
MAX_NUMBER = 1e18  # magnitude of any other number in a note (a decision's seconds, ratios)


@dataclass(frozen=True, slots=True)
class ComputeNote:
    op: str  # the operator it serves: materialize, extend, merge, resume, recompute, store-load
    state_id: str  # the state (or batch) it computes
    target: str | None  # the worker the plan chose
    reads: tuple[str, ...]  # keys of the cached blocks it reads
    decision: dict | None  # the plan's cost-model decision (flat: str -> number | str | None)
    first: bool  # the first branch on its destination: it pays the decision
    kv_out: int  # KV bytes its output adds to its worker
    predicted_s: float | None  # seconds the plan expects it to run
    gang: str | None  # tasks that must start together (a parallel prefill's chunks)
    gang_size: int  # how many tasks the gang has
    flow: str | None = None  # the workflow run it serves (admission's order under a budget)


@dataclass(frozen=True, slots=True)
class BlockNote:
    key: str  # the block's key: the task's own
    start: int  # first token position
    end: int  # one past the last
    nbytes: int  # tensor bytes
    tokens: tuple[int, ...]  # its token ids (the prefix index matches on them)
    parent: str | None  # the previous block of its chain (same namespace)
    fingerprint: str  # the model's fingerprint digest
    root: str  # the digest that seeded its key (first blocks hang under it)
    state_id: str  # the state it was made for
    device: str  # where its tensor lives
    source: str | None  # "store": loaded, not computed
    persist: bool  # its task also writes it to the store

    def meta(self) -> dict:
        """The catalog's block metadata (``KVCatalog.add_block``)."""
        return {"key": self.key, "start": self.start, "end": self.end, "nbytes": self.nbytes,
                "tokens": list(self.tokens), "parent": self.parent, "fingerprint": self.fingerprint,
                "root": self.root, "state_id": self.state_id, "device": self.device, "source": self.source,
                "persist": self.persist}


def shown(value) -> str:
    """``value`` for a one-line message: short, and never raising (``repr`` of an int past
    4300 digits does, and of a huge list takes long)."""
    try:
        return reprlib.repr(value)[:60]
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__}>"


def _fail(field: str, must: str, value) -> ValueError:
    return ValueError(f"kv annotation field {field!r} must be {must}, got {shown(value)}")


def _int(note: dict, field: str, lo: int, hi: int, default=None) -> int:
    v = note.get(field, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _fail(field, f"an integer in [{lo}, {hi}]", v)
    return v


def real(v, lo: float, hi: float) -> bool:
    """``v`` is an int or a finite float (no bool) in [lo, hi]: compared as it is, so an int
    of any size is refused without being converted (``float(10**400)`` raises)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return (not isinstance(v, float) or math.isfinite(v)) and lo <= v <= hi


def _seconds(note: dict, field: str) -> float | None:
    v = note.get(field)
    if v is None:
        return None
    if not real(v, 0, MAX_SECONDS):
        raise _fail(field, f"a number of seconds in [0, {MAX_SECONDS:g}]", v)
    return float(v)


def _text(note: dict, field: str, optional: bool = False, default: str | None = None) -> str | None:
    v = note.get(field, default)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise _fail(field, f"a string of at most {MAX_TEXT} characters", v)
    return v


def _strings(note: dict, field: str) -> tuple[str, ...]:
    v = note.get(field, ())
    if not isinstance(v, (list, tuple)) or len(v) > MAX_LIST or not all(isinstance(x, str) for x in v):
        raise _fail(field, f"a list of at most {MAX_LIST} strings", v)
    return tuple(v)


def _decision(note: dict) -> dict | None:
    v = note.get("decision")
    if v is None:
        return None
    ok = isinstance(v, dict) and len(v) <= 64 and all(
        isinstance(k, str) and len(k) <= MAX_TEXT and (
            x is None or isinstance(x, (bool, float)) or real(x, -MAX_NUMBER, MAX_NUMBER)
            or (isinstance(x, str) and len(x) <= MAX_TEXT))
        for k, x in v.items())
    if not ok:  # a float may be nan or inf (a link never measured): shown and kept, never summed
        raise _fail("decision", f"a flat mapping of names to floats, integers within ±{MAX_NUMBER:g}, short "
                                "strings or None", v)
    nbytes = v.get("nbytes", 0)
    if nbytes is not None and not real(nbytes, 0, MAX_BYTES):
        raise _fail("decision.nbytes", f"a byte count in [0, {MAX_BYTES}]", nbytes)
    return dict(v)


def compute_note(note: dict) -> ComputeNote:
    gang = _text(note, "gang", optional=True)
    first = note.get("first", False)
    if not isinstance(first, bool):
        raise _fail("first", "a boolean", first)
    return ComputeNote(
        op=_text(note, "op", default="compute"),
        state_id=_text(note, "state_id", optional=True) or "",
        target=_text(note, "target", optional=True),
        reads=_strings(note, "reads"),
        decision=_decision(note),
        first=first,
        kv_out=_int(note, "kv_out", 0, MAX_BYTES, default=0),
        predicted_s=_seconds(note, "predicted_s"),
        gang=gang,
        gang_size=_int(note, "gang_size", 1, MAX_GANG, default=1),
        flow=_text(note, "flow", optional=True),
    )


def block_note(key, note: dict) -> BlockNote:
    meta = note.get("meta")
    if not isinstance(meta, dict):
        raise _fail("meta", "a mapping", meta)
    if meta.get("key") != key or not is_block(key):
        raise ValueError(f"kv annotation of task {short_key(key)} names another block: a task may publish only "
                         "the block it computes")
    start = _int(meta, "start", 0, MAX_TOKENS)
    end = _int(meta, "end", start + 1, start + MAX_TOKENS)
    tokens = meta.get("tokens")
    if (not isinstance(tokens, (list, tuple)) or len(tokens) != end - start
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in tokens)):
        raise _fail("meta.tokens", f"{end - start} token ids", tokens)
    parent = _text(meta, "parent", optional=True)
    if parent is not None and (not is_block(parent) or tag_of(parent) != tag_of(key)):
        raise _fail("meta.parent", "a block key of the same namespace", parent)
    source = _text(meta, "source", optional=True)
    if source not in (None, "store"):
        raise _fail("meta.source", '"store" or None', source)
    persist = meta.get("persist", False)
    if not isinstance(persist, bool):
        raise _fail("meta.persist", "a boolean", persist)
    fingerprint = _text(meta, "fingerprint")
    return BlockNote(key, start, end, _int(meta, "nbytes", 0, MAX_BYTES), tuple(tokens), parent, fingerprint,
                     _text(meta, "root", default=fingerprint), _text(meta, "state_id", default=""),
                     _text(meta, "device", default="cpu"), source, persist)


def parse_note(key, note) -> ComputeNote | BlockNote:
    """The typed note of task ``key``, or ValueError (one line) naming the bad field."""
    if not isinstance(note, dict):
        raise _fail("kv", "a mapping", note)
    role = note.get("role")
    if role == "compute":
        return compute_note(note)
    if role == "block":
        return block_note(key, note)
    raise _fail("role", '"compute" or "block"', role)
