"""The KV catalog: (state, block) -> (worker, bytes, range, refcount, last access, status).

Plain data kept by the scheduler plugin. Where a block *is* (who_has, nbytes, who wants
it) stays Dask's business and is joined in when rows are produced; the catalog adds what
Dask does not know: token ranges, chain parents, which states share a block, lineage, how
often a block was read, and why it left memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..blocks import BlockRef
from ..prefix_index import PrefixIndex, PrefixMatch

LIFECYCLE = ("materialize", "fork", "transfer", "resume", "extend", "merge", "evict", "recompute", "release")


@dataclass(slots=True)
class BlockEntry:
    key: str  # content address, also the Dask key
    start: int  # first token position
    end: int  # one past the last token position
    nbytes: int  # tensor bytes
    parent: str | None  # previous block in the chain
    fingerprint: str  # fingerprint digest (model, tokenizer, dtype, namespace)
    state_id: str  # state that first produced it
    device: str = "cpu"  # where the tensor lives on its worker
    created: float = field(default_factory=time.time)
    last_access: float = field(default_factory=time.time)  # last time a task read it
    reuse_count: int = 0  # tasks that read it after it was made
    status: str = "pending"  # pending | memory | evicted | released | lost
    recomputes: int = 0  # times it was computed again after being lost


@dataclass(slots=True)
class StateEntry:
    state_id: str
    block_keys: tuple[str, ...]
    op: str  # the lineage event that made it
    parents: tuple[str, ...]
    tokens: int
    worker: str | None
    created: float = field(default_factory=time.time)
    status: str = "live"  # live | released


class KVCatalog:
    def __init__(self) -> None:
        self.blocks: dict[str, BlockEntry] = {}
        self.states: dict[str, StateEntry] = {}
        self.index = PrefixIndex()  # over blocks Dask still knows (pending or in memory)
        self.counters: dict[str, float] = {
            "tokens_reused": 0,
            "tokens_computed": 0,
            "bytes_transferred": 0,
            "transfers": 0,
            "recomputes": 0,
            "evictions": 0,
            "bytes_evicted": 0,
        }

    # -- blocks ---------------------------------------------------------------------------
    def add_block(self, meta: dict) -> BlockEntry:
        key = meta["key"]
        entry = self.blocks.get(key)
        if entry is None or entry.status in ("evicted", "released", "lost"):
            previous = entry
            entry = BlockEntry(
                key,
                meta["start"],
                meta["end"],
                meta["nbytes"],
                meta.get("parent"),
                meta["fingerprint"],
                meta.get("state_id", ""),
                device=meta.get("device", "cpu"),
            )
            if previous is not None:  # made again after it left memory
                entry.recomputes = previous.recomputes + 1
                self.count("recomputes")
            self.blocks[key] = entry
        ref = BlockRef(key, meta["start"], tuple(meta["tokens"]), meta["nbytes"])
        self.index.add(ref, meta.get("parent"), meta["fingerprint"])
        return entry

    def mark(self, key: str, status: str) -> None:
        entry = self.blocks.get(key)
        if entry is None:
            return
        entry.status = status
        if status in ("evicted", "released", "lost"):
            self.index.remove(key)

    def touch(self, key: str, now: float | None = None) -> None:
        entry = self.blocks.get(key)
        if entry is not None:
            entry.last_access = now or time.time()
            entry.reuse_count += 1

    def lookup(self, fingerprint: str, tokens, block_size: int) -> PrefixMatch:
        return self.index.longest_prefix(fingerprint, tokens, block_size)

    # -- states ---------------------------------------------------------------------------
    def add_state(self, meta: dict) -> None:
        self.states[meta["state_id"]] = StateEntry(
            meta["state_id"],
            tuple(meta["block_keys"]),
            meta.get("op", ""),
            tuple(meta.get("parents", ())),
            meta.get("tokens", 0),
            meta.get("worker"),
        )

    def release_state(self, state_id: str) -> None:
        if state_id in self.states:
            self.states[state_id].status = "released"

    def count(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    # -- export ---------------------------------------------------------------------------
    def rows(self, who_has: dict[str, list[str]], refcount: dict[str, int]) -> list[dict]:
        """One row per (state, block), plus one per block no live state lists."""
        out = []
        listed = set()
        for st in self.states.values():
            for key in st.block_keys:
                listed.add(key)
                out.append(self._row(st.state_id, st.status, key, who_has, refcount))
        for key in self.blocks.keys() - listed:
            out.append(self._row("", "", key, who_has, refcount))
        return out

    def _row(self, state_id, state_status, key, who_has, refcount) -> dict:
        b = self.blocks.get(key)
        return {
            "state_id": state_id,
            "state_status": state_status,
            "block_key": key,
            "workers": ",".join(who_has.get(key, [])),
            "device": "" if b is None else b.device,
            "nbytes": 0 if b is None else b.nbytes,
            "token_start": -1 if b is None else b.start,
            "token_end": -1 if b is None else b.end,
            "refcount": refcount.get(key, 0),
            "last_access": 0.0 if b is None else b.last_access,
            "reuse_count": 0 if b is None else b.reuse_count,
            "status": "unknown" if b is None else b.status,
            "lineage_state": "" if b is None else b.state_id,
        }


def rows_to_arrow(rows: list[dict]):
    import pyarrow as pa

    columns = [
        ("state_id", pa.string()),
        ("state_status", pa.string()),
        ("block_key", pa.string()),
        ("workers", pa.string()),
        ("device", pa.string()),
        ("nbytes", pa.int64()),
        ("token_start", pa.int64()),
        ("token_end", pa.int64()),
        ("refcount", pa.int64()),
        ("last_access", pa.float64()),
        ("reuse_count", pa.int64()),
        ("status", pa.string()),
        ("lineage_state", pa.string()),
    ]
    schema = pa.schema(columns)
    return pa.Table.from_pylist(rows, schema=schema)
