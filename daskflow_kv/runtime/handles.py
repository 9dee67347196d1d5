"""What a KVRuntime hands out: states whose blocks are futures, and generations.

``DistKVState`` is a descriptor plus the futures that keep its blocks alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from distributed import Future

from ..policy.placement import Placement
from ..state.kv_state import KVState

if TYPE_CHECKING:
    from .kv_runtime import KVRuntime


@dataclass(eq=False)
class DistKVState:
    """A KV state whose blocks are futures pinned to workers."""

    state: KVState  # the descriptor (fingerprint, blocks, lineage)
    futures: tuple[Future, ...]  # one per block; holding them keeps the blocks alive
    runtime: KVRuntime = field(repr=False)
    released: bool = False

    @property
    def state_id(self) -> str:
        return self.state.state_id

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.state.tokens

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def who_has(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.runtime.client.who_has(list(self.futures)).items()}

    def release(self) -> None:
        self.runtime.release(self)


@dataclass
class DistGeneration:
    tokens: list[int]  # generated ids
    text: str
    metrics: dict  # RunMetrics of the prefill + decode, measured on the worker
    worker: str  # where it ran
    placement: Placement  # the plan's decision for this branch
    state: DistKVState | None = None  # continuation state (its new blocks on ``worker``)
    logits: object = None
