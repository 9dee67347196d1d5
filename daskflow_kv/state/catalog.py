"""The KV catalog: (state, block) -> (workers, bytes, range, refcount, last access, status).

Plain data kept by the scheduler plugin. Where a block *is* (who_has, nbytes, who wants
it) stays Dask's business and is joined in when rows are produced; the catalog adds what
Dask does not know: token ranges, chain parents, which states share a block, lineage, how
often a block was read, and why it left memory.

Block lifecycle (``BlockEntry.status``)::

    pending -> memory -> released | evicted | lost -> recomputing -> memory -> ...
                                 \\-> forgotten (Dask dropped the key and its lineage)

Block tier (``tier`` in rows, where its bytes are now): ``memory`` (in a worker's memory),
``spilled`` (Dask spilled it to the worker's disk), ``store`` (only in the persistent store),
or empty (nowhere: released, lost, or being computed). ``persisted``: a copy is in the
persistent store. A persisted block stays listed after Dask forgets it (tier ``store``,
at most ``MAX_STORE_ONLY`` of them): eviction keeps the persisted copy.

``lost``: it left memory while still wanted (its worker died); Dask recomputes it.
``evicted``: the plugin released it under the byte budget. ``recomputing``: Dask is
computing it again from lineage. The prefix index holds every block Dask still knows
(any status but forgotten), by content address. A lookup stops at a released block: its
content is made again by a planned prefill under a fresh Dask key (``keys.rebuilt_key``),
which then takes its place in the index, instead of Dask's unplanned rerun of the whole
task that first made it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..keys import content_key
from .blocks import BlockRef
from .prefix_index import PrefixIndex, PrefixMatch

COUNTERS = (
    "tokens_reused",
    "tokens_computed",
    "bytes_transferred",
    "transfers",
    "recomputes",  # prefixes the cost model chose to rebuild on a destination
    "lineage_recomputes",  # blocks Dask computed again after they left memory
    "evictions",
    "bytes_evicted",
    "evictions_regretted",  # evicted blocks that were computed (or loaded) again later: the budget's misses
    "preemptions",  # waiting KV tasks the budget failed with KVPreempted to break a deadlock (their level is redone)
    "spills",  # pinned blocks the budget moved to a worker's spill disk to admit an older run's task (kept, not redone)
    "bytes_spilled",
    "bytes_read_back",  # spilled blocks admitted tasks read back into memory
    "store_writes",  # blocks workers wrote to the persistent store
    "store_bytes_written",
    "store_loads",  # blocks loaded from the store instead of prefilled
    "store_bytes_read",
    "store_corrupt",  # stored objects that failed verification (recomputed instead)
)
BLOCK_STATUSES = ("pending", "memory", "lost", "evicted", "released", "recomputing", "forgotten")
TIERS = ("memory", "spilled", "store", "")
MAX_STORE_ONLY = 4096  # persisted blocks Dask forgot that the catalog keeps listing (newest used)
MAX_RELEASED_STATES = 2048  # released states kept per namespace as history (lineage) while their blocks are cached
MAX_EVICTED = 65536  # evicted block keys remembered, newest kept, to count an eviction regretted


@dataclass(slots=True)
class BlockEntry:
    key: str  # the Dask key: the content address, or a rebuilt one's (``keys.rebuilt_key``)
    start: int  # first token position
    end: int  # one past the last token position
    nbytes: int  # tensor bytes
    parent: str | None  # previous block in the chain
    fingerprint: str  # fingerprint digest (model, tokenizer, dtype, namespace)
    state_id: str  # state that first produced it (lineage)
    namespace: str = ""  # the tenant whose client published it; only that tenant sees it
    device: str = "cpu"  # where the tensor lives on its worker
    created: float = field(default_factory=time.time)
    last_access: float = field(default_factory=time.time)  # last time a task read it
    reuse_count: int = 0  # tasks that read it after it was made
    status: str = "pending"  # see BLOCK_STATUSES
    computed: bool = False  # it has been in memory at least once
    recomputes: int = 0  # times it was computed again after leaving memory
    persisted: bool = False  # in the persistent store: loaded from it, written, or queued for writing


@dataclass(slots=True)
class StateEntry:
    state_id: str
    block_keys: tuple[str, ...]
    op: str  # the lineage event that made it
    parents: tuple[str, ...]
    tokens: int
    worker: str | None
    namespace: str = ""  # the tenant whose client registered it
    client: str | None = None  # the Dask client that registered it: its states end when it leaves
    created: float = field(default_factory=time.time)
    status: str = "live"  # live | released
    flow: str | None = None  # the workflow run that made it (whom the budget preempts to free it)


class KVCatalog:
    def __init__(self) -> None:
        self.blocks: dict[str, BlockEntry] = {}
        self.states: dict[str, StateEntry] = {}
        self.live_holders: dict[str, set[str]] = {}  # block key -> live states listing it
        self.index = PrefixIndex()  # blocks Dask still knows (any status but forgotten)
        self._counters: dict[str | None, dict[str, float]] = {}  # namespace (None: the cluster's) -> counters
        # content address -> its namespace, evicted and not back yet (under any Dask key)
        self._evicted: dict[str, str | None] = {}

    # -- blocks ---------------------------------------------------------------------------
    def add_block(self, meta: dict, namespace: str = "") -> BlockEntry:
        """A task producing this block was submitted (new, or again after it was forgotten).

        ``meta["root"]``: the digest that seeded the block's key (see ``blocks.keyed_digest``),
        under which first blocks hang in the prefix index.
        """
        key = meta["key"]
        entry = self.blocks.get(key)
        if entry is None:
            entry = self.blocks[key] = BlockEntry(
                key,
                meta["start"],
                meta["end"],
                meta["nbytes"],
                meta.get("parent"),
                meta["fingerprint"],
                meta.get("state_id", ""),
                namespace,
                device=meta.get("device", "cpu"),
            )
        elif entry.status == "forgotten":
            entry.status = "pending"
        if meta.get("source") == "store":  # loaded, not recomputed: its next memory entry is no recompute
            entry.persisted, entry.computed = True, False
        elif meta.get("persist"):  # its task queues the write; the writer holds the tensor till done
            entry.persisted = True
        ref = BlockRef(key, meta["start"], tuple(meta["tokens"]), meta["nbytes"])
        self.index.add(ref, meta.get("parent"), meta.get("root", meta["fingerprint"]))
        return entry

    def set_status(self, key: str, status: str) -> None:
        entry = self.blocks.get(key)
        if entry is not None:
            entry.status = status
            if status == "evicted":
                content = content_key(key)
                self._evicted.pop(content, None)
                self._evicted[content] = entry.namespace
                if len(self._evicted) > MAX_EVICTED:
                    del self._evicted[next(iter(self._evicted))]

    def entered_memory(self, key: str) -> bool:
        """Record a block reaching memory; True when it had been computed before (a recompute)."""
        entry = self.blocks.get(key)
        if entry is None:
            return False
        content = content_key(key)  # a rebuild under a fresh key makes good the same eviction
        if content in self._evicted:  # the budget let it go and it was needed again
            self.count("evictions_regretted", namespace=self._evicted.pop(content))
        again = entry.computed
        if again:
            entry.recomputes += 1
            self.count("lineage_recomputes", namespace=entry.namespace)
        entry.computed = True
        entry.status = "memory"
        return again

    def forget(self, key: str) -> None:
        """Dask dropped the key: out of the index; the entry goes unless a live state lists it."""
        self.index.remove(key)
        entry = self.blocks.get(key)
        if entry is None:
            return
        if entry.status != "evicted":
            entry.status = "forgotten"
        if not self.live_holders.get(key) and not entry.persisted:
            del self.blocks[key]

    def touch(self, key: str, now: float | None = None) -> None:
        entry = self.blocks.get(key)
        if entry is not None:
            entry.last_access = now or time.time()
            entry.reuse_count += 1

    def lookup(self, root: str, keys, tokens, block_size: int, namespace: str | None = None) -> PrefixMatch:
        """Longest cached prefix of a request given as its own chain ``keys`` and ``tokens``;
        only ``namespace``'s blocks count (None: every namespace, for an admin)."""
        allowed = None if namespace is None else (lambda b: self.blocks[b.key].namespace == namespace)
        return self.index.match(root, keys, tokens, block_size, allowed)

    def current_key(self, content: str) -> str:
        """The Dask key the content address ``content`` is indexed under (itself when not indexed)."""
        return self.index.current(content_key(content)) or content

    def namespace_of(self, key: str) -> str | None:
        entry = self.blocks.get(key)
        return None if entry is None else entry.namespace

    # -- states ---------------------------------------------------------------------------
    def add_state(self, meta: dict, namespace: str = "", client: str | None = None) -> None:
        st = StateEntry(
            meta["state_id"],
            tuple(meta["block_keys"]),
            meta.get("op", ""),
            tuple(meta.get("parents", ())),
            meta.get("tokens", 0),
            meta.get("worker"),
            namespace,
            client,
            flow=meta.get("flow"),
        )
        self.states[st.state_id] = st
        for key in st.block_keys:
            self.live_holders.setdefault(key, set()).add(st.state_id)

    def release_client(self, client: str) -> list[StateEntry]:
        """The live states ``client`` registered, released: it left (closed, or its process died)
        and nothing can release them any more. -> those states."""
        gone = [st for st in self.states.values() if st.client == client and st.status == "live"]
        for st in gone:
            self.release_state(st.state_id)
        return gone

    def release_state(self, state_id: str) -> None:
        st = self.states.get(state_id)
        if st is None or st.status == "released":
            return
        st.status = "released"
        for key in st.block_keys:
            holders = self.live_holders.get(key)
            if holders is not None:
                holders.discard(state_id)
                if not holders:
                    del self.live_holders[key]
                    entry = self.blocks.get(key)
                    if (entry is not None and entry.status in ("forgotten", "evicted") and key not in self.index
                            and not entry.persisted):
                        del self.blocks[key]

    def mark_persisted(self, key: str, persisted: bool = True) -> bool:
        entry = self.blocks.get(key)
        if entry is not None:
            entry.persisted = persisted
        return entry is not None

    def store_only(self) -> list[str]:
        """Blocks Dask forgot that the catalog lists only because the store has them."""
        return [k for k, e in self.blocks.items()
                if e.persisted and e.status in ("forgotten", "evicted") and k not in self.index
                and not self.live_holders.get(k)]

    def prune(self) -> int:
        """Drop released states whose blocks are all gone (history nobody can query), each
        namespace's earliest registered released states past ``MAX_RELEASED_STATES`` (a shared
        context stays cached across workflows, so history listing it would otherwise grow with
        every workflow; per namespace, so one tenant's stream cannot erase another's lineage),
        and the least recently used store-only blocks past ``MAX_STORE_ONLY``. -> states dropped."""
        extra = self.store_only()
        if len(extra) > MAX_STORE_ONLY:
            extra.sort(key=lambda k: self.blocks[k].last_access)
            for k in extra[: len(extra) - MAX_STORE_ONLY]:
                del self.blocks[k]
        gone = [sid for sid, st in self.states.items()
                if st.status == "released" and not any(k in self.blocks for k in st.block_keys)]
        for sid in gone:
            del self.states[sid]
        released: dict[str, list[str]] = {}  # namespace -> its released states, earliest registered first
        for sid, st in self.states.items():
            if st.status == "released":
                released.setdefault(st.namespace, []).append(sid)
        old = [sid for sids in released.values() for sid in sids[: max(0, len(sids) - MAX_RELEASED_STATES)]]
        for sid in old:
            del self.states[sid]
        return len(gone) + len(old)

    def count(self, name: str, value: float = 1, namespace: str | None = None) -> None:
        """Add to ``namespace``'s counter (None: the cluster's own, e.g. from an unattributed report)."""
        mine = self._counters.setdefault(namespace, dict.fromkeys(COUNTERS, 0))
        mine[name] = mine.get(name, 0) + value

    def counters_of(self, namespace: str | None) -> dict[str, float]:
        """``namespace``'s counters (None: the cluster's own)."""
        return {**dict.fromkeys(COUNTERS, 0), **self._counters.get(namespace, {})}

    def counter_by_namespace(self, name: str) -> dict[str | None, float]:
        """One counter of every namespace that counted anything (None: the cluster's own)."""
        return {ns: mine.get(name, 0) for ns, mine in self._counters.items()}

    @property
    def counters(self) -> dict[str, float]:
        """Every namespace's counters added up (the operator's)."""
        out = dict.fromkeys(COUNTERS, 0)
        for mine in self._counters.values():
            for name, v in mine.items():
                out[name] = out.get(name, 0) + v
        return out

    # -- export ---------------------------------------------------------------------------
    def rows(self, who_has: dict[str, list[str]], refcount: dict[str, int], cached: set[str],
             namespace: str | None = None, tiers: dict[str, str] | None = None) -> list[dict]:
        """One row per (state, block), plus one per block no state lists; only ``namespace``'s
        (None: all of them)."""
        out = []
        listed = set()
        for st in self.states.values():
            if namespace is not None and st.namespace != namespace:
                continue
            for key in st.block_keys:
                listed.add(key)
                out.append(self._row(st, key, who_has, refcount, cached, tiers or {}))
        for key in self.blocks.keys() - listed:
            if namespace is None or self.blocks[key].namespace == namespace:
                out.append(self._row(None, key, who_has, refcount, cached, tiers or {}))
        return out

    def _row(self, st: StateEntry | None, key, who_has, refcount, cached, tiers) -> dict:
        b = self.blocks.get(key)
        return {
            "namespace": (st.namespace if st is not None else "") if b is None else b.namespace,
            "state_id": "" if st is None else st.state_id,
            "state_status": "" if st is None else st.status,
            "state_op": "" if st is None else st.op,
            "state_parents": "" if st is None else ",".join(st.parents),
            "block_key": key,
            "parent_key": "" if b is None else (b.parent or ""),
            "workers": ",".join(who_has.get(key, [])),
            "device": "" if b is None else b.device,
            "nbytes": 0 if b is None else b.nbytes,
            "token_start": -1 if b is None else b.start,
            "token_end": -1 if b is None else b.end,
            "refcount": refcount.get(key, 0),
            "cached": key in cached,
            "last_access": 0.0 if b is None else b.last_access,
            "reuse_count": 0 if b is None else b.reuse_count,
            "status": "forgotten" if b is None else b.status,
            "recomputes": 0 if b is None else b.recomputes,
            "lineage_state": "" if b is None else b.state_id,
            "tier": tiers.get(key, "store" if b is not None and b.persisted else ""),
            "persisted": False if b is None else b.persisted,
        }


ARROW_COLUMNS = (
    ("namespace", "string"),
    ("state_id", "string"),
    ("state_status", "string"),
    ("state_op", "string"),
    ("state_parents", "string"),
    ("block_key", "string"),
    ("parent_key", "string"),
    ("workers", "string"),
    ("device", "string"),
    ("nbytes", "int64"),
    ("token_start", "int64"),
    ("token_end", "int64"),
    ("refcount", "int64"),
    ("cached", "bool_"),
    ("last_access", "float64"),
    ("reuse_count", "int64"),
    ("status", "string"),
    ("recomputes", "int64"),
    ("lineage_state", "string"),
    ("tier", "string"),
    ("persisted", "bool_"),
)


def rows_to_arrow(rows: list[dict]):
    import pyarrow as pa

    schema = pa.schema([(name, getattr(pa, typ)()) for name, typ in ARROW_COLUMNS])
    return pa.Table.from_pylist(rows, schema=schema)
