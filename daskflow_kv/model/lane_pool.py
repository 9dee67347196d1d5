"""One K/V tensor per layer for the step loop's solo lanes, so their decode rows attend at once.

A lane whose group is its own (one request over its own prefix: the usual case under a
stream of workflows) keeps ``[prefix | its tokens]`` contiguous in a workspace. If every
such workspace is a *slot* of one ``[slots, kvh, capacity, d]`` tensor per layer, a step's
decode rows attend in one matmul-softmax-matmul over the slots, each row masked to its own
length (``step_cache.StepCache``), instead of one small kernel call per request per layer,
whose dispatch cost on a CPU outweighs its arithmetic at decode sizes.

The price is padding: every slot is as long as the longest lane's workspace. A lane that
would stretch the pool past ``MAX_STRETCH`` times its current length keeps a workspace of
its own (and attends alone). The pool grows by copying (slots x2; length to the need,
rounded up), is freed when its last lane leaves, and starts with zeros: masked keys are
multiplied by an exact zero weight, so what sits past a lane's length must stay finite.

A pool never grows past ``max_bytes`` (``daskflow-kv.batching.pool-bytes``): a lane that would
take it further keeps a workspace of its own, sized to its need. Unbounded, a stream of
1,024-token prompts on a loaded CPU worker doubled the pool to tens of ~60 MB slots, the old
and new tensors held at once while copying, and Dask's nanny restarted the worker at 95 %
of its 8 GiB (2026-12-06); the slots between a step's decode rows are computed too
(``step_cache._PoolRows``), so a wide, sparse pool also costs time.

A new pool takes ``FIRST_SLOTS`` slots, fewer when they would pass ``FIRST_BYTES``: a
lone request over a long prefix otherwise zeroed four workspaces to use one, and fresh
pages cost more than the copy itself (a 4,096-token SmolLM2 prefix: 778 MB zeroed, its
resume's load 0.22-1.59 s against 0.03-0.05 s for a shared group's exact-size buffer,
warm exp 1 on a 2-core VM, 2026-12-05).
"""

from __future__ import annotations

import torch

ROUND = 128  # slot lengths are multiples of this, so a slightly longer newcomer rarely forces a copy
MAX_STRETCH = 4  # a lane may lengthen every slot this many times at most (its padding)
FIRST_SLOTS = 4  # slots a new pool starts with, so that the next lanes join without a copy...
FIRST_BYTES = 256 << 20  # ...unless that many slots would take more than this (then fewer, at least one)
MAX_BYTES = 1 << 30  # the default bound on a pool's tensors (``batching.pool-bytes``)


class LanePool:
    """Slots of one K/V tensor per layer; a slot holds one solo group's workspace."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, max_bytes: int = MAX_BYTES):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_bytes = int(max_bytes)  # the pool's tensors never grow past this
        self.k: list[torch.Tensor] = []  # per layer [slots, kvh, capacity, d]
        self.v: list[torch.Tensor] = []
        self.owners: list = []  # per slot: the group in it, or None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def accepts(self, length: int) -> bool:
        """Would a workspace of ``length`` tokens join without padding every slot too much, and
        without growing the pool past ``max_bytes``? (An empty pool takes any one lane.)"""
        if not any(self.owners):
            return True
        if length > MAX_STRETCH * self.capacity:
            return False
        return self._slots_after_join() * self._slot_bytes(max(self.capacity, _rounded(length))) <= self.max_bytes

    def place(self, group, length: int) -> int:
        """Give ``group`` a slot of at least ``length`` tokens; sets ``group.ws`` to its views."""
        free = next((i for i, g in enumerate(self.owners) if g is None), None)
        capacity = max(self.capacity, _rounded(length))
        if self.owners:
            slots = self._slots_after_join()
        else:
            slots = max(1, min(FIRST_SLOTS, min(FIRST_BYTES, self.max_bytes) // self._slot_bytes(capacity)))
        if free is None or length > self.capacity:
            self._grow(slots, capacity)
            free = self.owners.index(None)
        self.owners[free] = group
        group.slot = free
        group.ws = self._views(free, length)
        return free

    def release(self, group) -> None:
        self.owners[group.slot] = None
        group.slot = None
        if not any(self.owners):  # the last lane left: give the memory back
            self.k, self.v, self.owners = [], [], []

    def _slots_after_join(self) -> int:
        """A non-empty pool's slots once one more lane joins: as many if one is free, else twice."""
        return len(self.owners) if None in self.owners else 2 * len(self.owners)

    def _views(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[slot : slot + 1, :, :length], v[slot : slot + 1, :, :length]) for k, v in zip(self.k, self.v)]

    def _grow(self, slots: int, capacity: int) -> None:
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        old_k, old_v, n, c = self.k, self.v, len(self.owners), self.capacity
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for new, old in ((self.k, old_k), (self.v, old_v)):
            for t, o in zip(new, old):
                t[:n, :, :c].copy_(o)
        self.owners += [None] * (slots - n)
        for slot, group in enumerate(self.owners):  # the old tensors go: point every group at the new ones
            if group is not None:
                group.ws = self._views(slot, group.ws[0][0].shape[2])

    def _slot_bytes(self, capacity: int) -> int:
        return 2 * self.layers * self.kv_heads * capacity * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def _rounded(length: int) -> int:
    return -(-length // ROUND) * ROUND
