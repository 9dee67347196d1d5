"""KVState: the paper's S = (M, Theta, B, Pi, Lambda, Gamma) as a small picklable descriptor.

M, Theta   -> ``fingerprint`` (model, config, tokenizer, dtype, rope, namespace)
B          -> ``blocks`` (content-addressed keys; tensors live in a store or on workers)
Pi         -> positions: a state always covers tokens [0, length) of its own sequence
Lambda     -> ``lineage`` (materialize / fork / extend / resume / merge / transfer events)
Gamma      -> placement: ``device`` and, under the Dask runtime, ``worker``

Descriptors are immutable: an operator returns a new one. Forks share block keys, so a
fork is a few hundred bytes however long the context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .. import keys
from .blocks import BlockRef
from .fingerprint import Fingerprint


def new_state_id(op: str) -> str:
    return keys.state_id(op)


@dataclass(frozen=True, slots=True)
class LineageEvent:
    op: str  # materialize | fork | extend | resume | merge | transfer | recompute
    state_id: str  # the state this event produced
    parents: tuple[str, ...]  # state ids it was derived from
    detail: tuple[tuple[str, object], ...] = ()  # small facts: tokens reused/computed, workers

    def as_dict(self) -> dict:
        return {"op": self.op, "state_id": self.state_id, "parents": list(self.parents), **dict(self.detail)}


@dataclass(frozen=True, slots=True)
class KVState:
    state_id: str  # unique per descriptor (forks differ, blocks may not)
    fingerprint: Fingerprint  # what the blocks are valid for
    block_size: int  # tokens per full block
    blocks: tuple[BlockRef, ...]  # aligned blocks covering [0, length)
    lineage: tuple[LineageEvent, ...] = ()  # oldest first; last event produced this state
    device: str = "cpu"  # where the block tensors live
    worker: str | None = None  # Dask worker address holding the blocks, if distributed
    meta: tuple[tuple[str, object], ...] = field(default=(), compare=False)  # free-form labels

    @property
    def length(self) -> int:
        return self.blocks[-1].end if self.blocks else 0

    @property
    def positions(self) -> tuple[int, int]:
        return (0, self.length)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(itertools.chain.from_iterable(b.token_ids for b in self.blocks))

    @property
    def block_keys(self) -> tuple[str, ...]:
        return tuple(b.key for b in self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def last_key(self) -> str | None:
        return self.blocks[-1].key if self.blocks else None

    def ancestors(self) -> set[str]:
        """Every state id this state was derived from, itself included."""
        out = {self.state_id}
        for ev in self.lineage:
            out.update(ev.parents)
            out.add(ev.state_id)
        return out

    def own_blocks(self, parent: "KVState") -> tuple[BlockRef, ...]:
        """Blocks this state holds that ``parent`` does not (the branch's own continuation)."""
        shared = set(parent.block_keys)
        return tuple(b for b in self.blocks if b.key not in shared)

    def derive(self, op: str, parents: tuple[str, ...], blocks=None, **detail) -> "KVState":
        """A new descriptor produced by ``op``; lineage grows by one event."""
        sid = new_state_id(op)
        event = LineageEvent(op, sid, parents, tuple(sorted(detail.items())))
        return replace(
            self,
            state_id=sid,
            blocks=self.blocks if blocks is None else tuple(blocks),
            lineage=self.lineage + (event,),
        )

    def describe(self) -> str:
        return (
            f"{self.state_id}: {self.length} tokens in {len(self.blocks)} blocks "
            f"({self.nbytes / 2**20:.2f} MiB, {self.fingerprint.model_id}, {self.fingerprint.dtype}, "
            f"{self.worker or self.device})"
        )
