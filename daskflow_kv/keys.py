"""Every name daskflow-kv puts into Dask: key kinds, their constructors and parsers, topics.

One vocabulary for the client, the workers, the scheduler plugin and the store (as the P2P
shuffle's ``barrier_key`` / ``id_from_key``). A Dask key of ours is
``<kind>-<ident…>-<tag>-<hex>``: ``<tag>`` (always the last part but one) names the
namespace whose task computes it (``namespace_tag``: 8 hex digits of a hash of the
namespace's name), so the scheduler plugin can tell whose a key is before it lets a task
run under it; ``<hex>`` is a block's content address or a task's random tail:

=================  ==========================================================================
``kvblock-…``      a content-addressed KV block (``state.blocks.block_key``): what the catalog
                   lists, the budget evicts and the store persists; ``kvblock-g<hex>-…``:
                   the same content made again after Dask released its first key
                   (``rebuilt_key``: Dask keeps a key's first run spec)
``kvprefill-…``    a prefill's output: the new blocks' tensors before they are cut into keys
                   (``kvprefill-branch-…``: one branch's, cut from a batched prefill's)
``kvresult-…``     the small, tensor-free result of a prefill (tokens, metrics)
``kvreplica-…``    a prefix rebuilt on the worker that reads it (a recompute plan)
``kvstoreload-…``  blocks read from the persistent store, before they are cut into keys
``kvpersist-…``    a low-priority task that queues store writes of blocks already in memory
``kvtool-…``       a workflow's tool call (``flow.tool_calls``): text, never K/V, so none of
                   ``KINDS`` - the plugin neither places nor counts it
=================  ==========================================================================

(The local ``Engine`` tags its block keys with its namespace too: they are no Dask keys,
but the same content addresses a runtime of that namespace publishes.)

Torch-free and Dask-free: the scheduler plugin, the store and the dashboard import it.
"""

from __future__ import annotations

import hashlib
import re
import secrets

BLOCK = "kvblock"
PREFILL = "kvprefill"
RESULT = "kvresult"
REPLICA = "kvreplica"
STORE_LOAD = "kvstoreload"
PERSIST = "kvpersist"
TOOL = "kvtool"  # a tool call's task (not one of KINDS: it holds text, placed by Dask alone)
STATE = "kvstate"  # a state id (not a Dask key): kvstate-<op>-<12 hex>

KINDS = (BLOCK, PREFILL, RESULT, REPLICA, STORE_LOAD, PERSIST)
# Kinds whose task the plan places (the plugin restricts, loosens and re-places them).
PLACED = (PREFILL, BLOCK, RESULT, REPLICA, STORE_LOAD)
# Kinds whose value holds K/V tensors on a worker (what the budget counts).
HOLDS_KV = (BLOCK, PREFILL, REPLICA, STORE_LOAD)
# Outputs other keys are cut from: a block cut from one shares its tensors while both are held.
OUTPUTS = (PREFILL, STORE_LOAD)

# Names on the wire.
PLUGIN_NAME = "daskflow-kv"  # the scheduler plugin, in ``scheduler.plugins``
EVENT_TOPIC = "daskflow-kv"  # lifecycle events in Dask's event log (keys cut short)
PREFILL_TOPIC = "daskflow-kv-prefill"  # prefill timings workers report (no keys, no tokens)
REPORT_OP = "kv_worker_report"  # worker -> scheduler plugin, on the worker's stream: spilled blocks, store I/O
REPORT_HELLO_RPC = "kv_report_hello"  # worker -> scheduler: send me my report token
REPORT_TOKEN_RPC = "kv_report_token"  # scheduler -> the worker's own address: the token its reports carry
SPILL_OP = "kv_spill"  # scheduler -> worker, on the scheduler's stream to it: KV blocks to move to its spill disk
BIND_OP = "kv_bind"  # client -> scheduler plugin, on the client's stream: the login nonce it answers
CACHE_CLIENT = "daskflow-kv-cache"  # scheduler-side pseudo-client that keeps published blocks
HOLD_WORKER = "daskflow-kv://awaiting-admission"  # a worker that never exists: parks held tasks


def _prefixes(kinds) -> tuple[str, ...]:
    return tuple(k + "-" for k in kinds)


_ALL = _prefixes(KINDS)
_PLACED = _prefixes(PLACED)
_HOLDS_KV = _prefixes(HOLDS_KV)
_OUTPUTS = _prefixes(OUTPUTS)


TAG_HEX = 8  # hex digits of a namespace tag
_TAG_RE = re.compile(rf"^[0-9a-f]{{{TAG_HEX}}}$")
_HEX_RE = re.compile(r"^[0-9a-f]{16,}$")  # a block's content address or a task key's random tail
_GEN = "g"  # a rebuilt block's generation: "g" and 8 random hex digits (never a tag: not hex)
_GEN_RE = re.compile(rf"^{_GEN}[0-9a-f]{{8}}$")


# -- constructors -------------------------------------------------------------------------------
def namespace_tag(namespace: str) -> str:
    """The tag a namespace's keys carry: 8 hex digits of a hash of its name. It names the
    namespace (anyone can compute it from the name); the scheduler plugin lets a task run
    under a tagged key only for a session of that namespace."""
    if not isinstance(namespace, str):
        raise TypeError(f"a namespace is a string, not {namespace!r}")
    return hashlib.sha256(b"daskflow-kv/namespace-tag/v1|" + namespace.encode()).hexdigest()[:TAG_HEX]


def block_key(digest_hex: str, namespace: str | None = None) -> str:
    """The Dask key of ``namespace``'s block whose content address is ``digest_hex``
    (``kvblock-<tag>-<digest>``; no namespace: ``kvblock-<digest>``, the local engine's)."""
    if namespace is None:
        return f"{BLOCK}-{digest_hex}"
    return f"{BLOCK}-{namespace_tag(namespace)}-{digest_hex}"


def rebuilt_key(block: str) -> str:
    """A fresh Dask key for the content of ``block`` (``kvblock-g<8 hex>-<tag>-<digest>``).

    An evicted block whose key Dask still keeps as lineage (a later block was cut from the
    same prefill) can only be computed again by Dask's own rerun of its first task, unplanned
    and whole. A planned rebuild of only what is missing needs a key Dask does not know; the
    content address, which chains and store objects are named by, stays ``content_key``'s.
    """
    return f"{BLOCK}-{_GEN}{secrets.token_hex(4)}-{content_key(block)[len(BLOCK) + 1:]}"


def task_key(kind: str, namespace: str, *ident) -> str:
    """Key of a task of ``namespace`` whose result holds K/V or a user's tokens:
    ``<kind>-<ident…>-<tag>-<16 hex>``.

    Dask serves any key to any client that names it; the random tail keeps these from being
    named by whoever read a state id in an event or on the dashboard.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown key kind {kind!r}; expected one of {KINDS}")
    parts = [kind, *(str(i) for i in ident if i not in (None, "")), namespace_tag(namespace), secrets.token_hex(8)]
    return "-".join(parts)


def tool_key(name: str, namespace: str) -> str:
    """Key of a tool call ``name`` of ``namespace``: ``kvtool-<name>-<tag>-<16 hex>``; the
    random tail keeps its output (a user's text) from being named by anyone else."""
    ident = re.sub(r"[^A-Za-z0-9_.]", "_", str(name))[:40]
    return "-".join((TOOL, ident, namespace_tag(namespace), secrets.token_hex(8)))


def state_id(op: str) -> str:
    return f"{STATE}-{op}-{secrets.token_hex(6)}"


# -- parsers ------------------------------------------------------------------------------------
def kind_of(key) -> str | None:
    """The kind of one of our keys (``"kvblock"``...), None for any other key."""
    k = str(key)
    head = k.split("-", 1)[0]
    return head if head in KINDS and len(k) > len(head) + 1 else None


def tag_of(key) -> str | None:
    """The namespace tag of one of our keys; None for an untagged key or any other key."""
    if kind_of(key) is None:
        return None
    parts = str(key).rsplit("-", 2)
    return parts[1] if len(parts) == 3 and _TAG_RE.match(parts[1]) and _HEX_RE.match(parts[2]) else None


def content_key(block) -> str:
    """The content address of a block key: itself, or a rebuilt key without its generation."""
    k = str(block)
    parts = k.split("-", 2)
    if len(parts) == 3 and parts[0] == BLOCK and _GEN_RE.match(parts[1]):
        return f"{BLOCK}-{parts[2]}"
    return k


def is_kv(key) -> bool:
    """One of our keys, of any kind: what only a namespace's own task may compute."""
    return str(key).startswith(_ALL)


def is_block(key) -> bool:
    return str(key).startswith(BLOCK + "-")


def is_placed(key) -> bool:
    """A task the plan places: its restriction is ours to loosen when its worker dies."""
    return str(key).startswith(_PLACED)


def holds_kv(key) -> bool:
    """A key whose value holds K/V tensors (blocks, outputs, replicas)."""
    return str(key).startswith(_HOLDS_KV)


def is_output(key) -> bool:
    """A prefill's or a store load's output, which blocks are cut from."""
    return str(key).startswith(_OUTPUTS)


def short_key(key) -> str:
    """One of our keys cut to its kind, ident and 8 hex digits: names it in logs and on
    pages, cannot fetch it. Other keys unchanged."""
    k = "" if key is None else str(key)
    if kind_of(k) is None:
        return k
    return k[: k.rfind("-") + 9] + "…"
