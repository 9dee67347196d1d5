"""New states: their descriptors and lineage, registered with the plugin in one call.

Every operator ends here. ``create`` makes the descriptor of each new state (its blocks,
its lineage: the parents' history then one event) and the handle holding its block
futures; ``adopt`` registers descriptors that reuse an existing state's futures (forks, a
concatenating merge). One ``kv_register_states`` call per operation, however many states:
per-state calls cost a scheduler round trip each; adopted states (they add no block) ride on
the runtime's next call instead, most often the parent's release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from distributed import Future

from ..state.blocks import BlockRef
from ..state.fingerprint import Fingerprint
from ..state.kv_state import KVState, LineageEvent
from .handles import DistKVState
from .plugin_client import PluginClient
from .workflow_run import current_run

if TYPE_CHECKING:
    from .kv_runtime import KVRuntime

CATALOG_DETAIL = ("tokens_reused", "tokens_computed")  # lineage details the catalog records


@dataclass(frozen=True, slots=True)
class NewState:
    state_id: str  # its id (``new_state_id``)
    refs: Sequence[BlockRef]  # its blocks, in token order
    futures: Sequence[Future]  # one per block
    op: str  # the operator that made it
    parents: Sequence[DistKVState]  # the states it was made from (their lineage comes first)
    worker: str | None  # where its new blocks are
    detail: Mapping[str, object] = field(default_factory=dict)  # the lineage event's details


@dataclass(slots=True, eq=False)
class StateRegistry:
    plugin: PluginClient  # registers states with the catalog
    fingerprint: Fingerprint  # the model's, on every descriptor
    block_size: int  # tokens per block
    device: str  # where blocks live
    owner: KVRuntime = field(repr=False)  # the runtime every handle answers to (release, who_has)

    def create(self, states: Sequence[NewState]) -> list[DistKVState]:
        """Handles for new states, all registered in one call."""
        descs, handles = [], []
        for s in states:
            event = LineageEvent(s.op, s.state_id, tuple(p.state_id for p in s.parents), tuple(sorted(s.detail.items())))
            history = tuple(dict.fromkeys(ev for p in s.parents for ev in p.state.lineage))
            desc = KVState(s.state_id, self.fingerprint, self.block_size, tuple(s.refs), history + (event,),
                           self.device, s.worker)
            descs.append(desc)
            handles.append(DistKVState(desc, tuple(s.futures), self.owner))
        self.register(descs, [s.detail for s in states])
        return handles

    def adopt(self, descs: Sequence[KVState], futures: tuple[Future, ...]) -> list[DistKVState]:
        """Handles for descriptors that share ``futures`` (their parent's blocks), registered
        with this runtime's next call (they add no block: ``PluginClient.register_states``)."""
        self.register(descs, later=True)
        return [DistKVState(d, futures, self.owner) for d in descs]

    def register(self, descs: Sequence[KVState], details: Sequence[Mapping] | None = None,
                 later: bool = False) -> None:
        details = details or [{}] * len(descs)
        metas = [
            {
                "state_id": d.state_id,
                "block_keys": list(d.block_keys),
                "op": d.lineage[-1].op if d.lineage else "",
                "parents": list(d.lineage[-1].parents) if d.lineage else [],
                "tokens": d.length,
                "worker": d.worker,
                **{k: v for k, v in detail.items() if k in CATALOG_DETAIL},
            }
            for d, detail in zip(descs, details)
        ]
        run = current_run()
        if run is not None:  # whose they are, should the budget need to preempt a run to make room
            for meta in metas:
                meta["flow"] = run
        self.plugin.register_states(metas, later)
