"""The KV of every request in a worker's running batch, for one packed forward per step.

A step feeds many requests at once: their rows are packed into one sequence
(``[1, total rows]``, each row with its own position), so the weight matmuls run once for
all of them, while attention stays per request. Each request is a *lane*; lanes that read
the same prefix (the forks of one state, submitted together) form a *group*:

* a group holds its prefix once, per layer, in a workspace ``[1, kvh, P + room, d]`` that
  attention reads in place (the prefix is copied there once, when the group joins);
* a group of one lane keeps that lane's own tokens in the workspace right after the
  prefix: its keys are contiguous, nothing is copied per step; on fp32 SDPA models that
  workspace is a slot of the engine's ``LanePool``, so every such lane's decode row of a
  step attends in one call (``_PoolRows``: masked to each row's length and window);
* a group of several lanes keeps each lane's tokens in its own tail buffer and copies
  them after the prefix just before that lane's attention, as ``batched_cache``'s replay
  mode does (the tails are short; the prefix is never copied again).

Attention for a lane is the model's own kernel over ``[prefix | lane's tokens]`` with the
mask a single-request forward would get (full or sliding window): the same function over
the same keys as ``ModelRunner.run`` with a cache, so a lane's attention matches a single
resume; only the batched weight matmuls (and pooled decode rows' padded softmax) round
differently (~1e-6 relative in fp32, see ``batched_cache``). Models whose attention this
cannot reproduce, and models below fp32, never come here: the step engine runs them in
their own rows (``ModelRunner``'s path).
"""

from __future__ import annotations

import sys

import torch

from .batched_cache import CTX_KW, single_mask
from .lane_pool import LanePool


class Group:
    """Lanes over one prefix: the prefix once per layer, in a workspace attention reads."""

    __slots__ = ("prefix_len", "ws", "lanes", "shared", "slot")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, prefix_len: int, room: int, shared: bool,
                 dtype, device, pool: LanePool | None = None):
        self.prefix_len = prefix_len  # P: tokens every lane of the group reads first
        self.lanes: list[Lane] = []  # lanes still running
        self.shared = shared  # several lanes: tails live in their own buffers
        self.slot: int | None = None  # its slot in the engine's LanePool (a solo group there), or None
        # per layer (K, V): [:P] the prefix; after it the lane's own tokens (one lane) or a
        # scratch area each lane's tail is copied into before its attention (several)
        if pool is not None:
            pool.place(self, prefix_len + room)  # sets self.ws to views of its slot
            return
        shape = (1, kv_heads, prefix_len + room, head_dim)
        self.ws = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                   for _ in range(layers)]

    def fit(self, room: int) -> None:
        """Make room for ``room`` tokens after the prefix (a shared group's scratch area):
        a member with a longer tail joined. The prefix moves once; lanes' tails are elsewhere."""
        have = self.ws[0][0].shape[2] - self.prefix_len
        if room <= have:
            return
        assert self.slot is None, "a pooled (solo) group is made with its whole room"
        P = self.prefix_len
        grown = []
        for k, v in self.ws:
            shape = (*k.shape[:2], P + room, k.shape[3])
            nk, nv = k.new_empty(shape), v.new_empty(shape)
            nk[:, :, :P].copy_(k[:, :, :P])
            nv[:, :, :P].copy_(v[:, :, :P])
            grown.append((nk, nv))
        self.ws = grown

    def load_prefix(self, blocks: list[torch.Tensor]) -> None:
        """Copy the first P tokens of ``blocks`` ([layers, 2, kvh, t, d] each) in, once."""
        pos, P = 0, self.prefix_len
        for block in blocks:
            take = min(block.shape[3], P - pos)
            if take <= 0:
                break
            block = block.to(self.ws[0][0].device, non_blocking=True)
            for (k, v), layer in zip(self.ws, block):
                k[0, :, pos : pos + take].copy_(layer[0, :, :take])
                v[0, :, pos : pos + take].copy_(layer[1, :, :take])
            pos += take
        if pos < P:
            raise ValueError(f"prefix blocks hold {pos} tokens, fewer than the {P} asked for")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.ws for t in pair)


class Lane:
    """One request's tokens after its group's prefix."""

    __slots__ = ("group", "cap", "length", "tail")

    def __init__(self, group: Group, cap: int, kv_heads: int, head_dim: int, dtype, device):
        self.group = group
        self.cap = cap  # tokens it will feed at most: its prompt's new part + generated - 1
        self.length = 0  # tokens fed so far
        shape = (kv_heads, cap, head_dim)
        # per layer (K, V) [kvh, cap, d] when the group is shared; None: in the workspace
        self.tail = ([(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                      for _ in range(len(group.ws))] if group.shared else None)

    def own(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where this lane's tokens live for ``layer``, as [kvh, cap, d] views."""
        if self.tail is not None:
            return self.tail[layer]
        P = self.group.prefix_len
        k, v = self.group.ws[layer]
        return k[0, :, P:], v[0, :, P:]

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of absolute positions [start, end) as [kvh, end - start, d] (for export)."""
        P = self.group.prefix_len
        pk, pv = self.group.ws[layer]
        tk, tv = self.own(layer)
        ks, vs = [], []
        if start < P:
            ks.append(pk[0, :, start : min(end, P)])
            vs.append(pv[0, :, start : min(end, P)])
        if end > P:
            s = max(start, P) - P
            ks.append(tk[:, s : end - P])
            vs.append(tv[:, s : end - P])
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    @property
    def nbytes(self) -> int:
        return 0 if self.tail is None else sum(t.numel() * t.element_size() for pair in self.tail for t in pair)


class StepCache:
    """The transformers cache of one packed forward: ``begin`` a step, run it, ``end`` it."""

    def __init__(self, config, dtype, device, pool: LanePool | None = None):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.config = config  # the ORIGINAL model config: its kernel and masks are replayed per lane
        self.dtype, self.device = dtype, device
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)  # None: eager
        # One decode row of a plain softmax attention (SDPA, fp32, no soft-capping) is a small
        # matmul-softmax-matmul: done directly it skips SDPA's per-call threading overhead, which
        # on a CPU is ~4x the arithmetic at these sizes and is paid per request per layer.
        self.decode_fast = (config._attn_implementation == "sdpa" and dtype == torch.float32
                            and getattr(config, "attn_logit_softcapping", None) is None)
        self._lanes: list[Lane] = []  # this step's lanes, in packed order
        self._spans: list[tuple[int, int]] = []  # their rows [start, end) in the packed sequence
        self._pos: torch.Tensor | None = None  # [1, rows] position ids
        self._masks: dict = {}  # (q, past, window) -> mask, for this step
        self.pool = pool  # where solo groups live; their decode rows attend together (``_PoolRows``)
        self._pooled: _PoolRows | None = None  # this step's decode rows in the pool
        # the last step's pooled attention: (rows, slots attended, keys per slot); the slots
        # between its rows' and every key up to the longest are computed too (StepShape)
        self.pooled_shape = (0, 0, 0)

    # -- one step -------------------------------------------------------------------------------
    def begin(self, lanes: list[Lane], q_lens: list[int], position_ids: torch.Tensor) -> None:
        for lane, q in zip(lanes, q_lens):
            if lane.length + q > lane.cap:
                raise RuntimeError(f"a lane would exceed its capacity of {lane.cap} tokens")
        self._lanes = list(lanes)
        ends = torch.tensor(q_lens).cumsum(0).tolist()
        self._spans = [(e - q, e) for e, q in zip(ends, q_lens)]
        self._pos = position_ids
        self._masks = {}
        self._pooled = None
        if self.decode_fast and self.pool is not None:
            rows = [(lane, a) for lane, (a, b) in zip(lanes, self._spans) if b - a == 1 and lane.group.slot is not None]
            if len(rows) > 1:  # one row attends as fast alone
                self._pooled = _PoolRows(rows, self.device)
        p = self._pooled
        self.pooled_shape = (len(p.lanes), p.n.shape[0], p.width) if p is not None else (0, 0, 0)

    def end(self) -> None:
        for lane, (a, b) in zip(self._lanes, self._spans):
            lane.length += b - a
        self._lanes, self._spans, self._pos, self._pooled = [], [], None, None

    # -- transformers cache protocol ---------------------------------------------------------------
    is_compileable = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write each lane's new rows where its tokens live."""
        pooled = self._pooled
        if pooled is not None:  # the pool's decode rows: one indexed write per tensor
            pooled.write(self.pool.k[layer_idx], key_states)
            pooled.write(self.pool.v[layer_idx], value_states)
        for lane, (a, b) in zip(self._lanes, self._spans):
            if pooled is not None and lane in pooled.lanes:
                continue
            tk, tv = lane.own(layer_idx)
            tk[:, lane.length : lane.length + b - a].copy_(key_states[0, :, a:b])
            tv[:, lane.length : lane.length + b - a].copy_(value_states[0, :, a:b])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((lane.group.prefix_len + lane.length for lane in self._lanes), default=0)

    # -- attention ---------------------------------------------------------------------------------
    def attend(self, module, query, scaling, kwargs):
        """Each lane's query rows against [its prefix | its tokens], the model's own kernel."""
        layer = module.layer_idx
        attention = self.attention or sys.modules[type(module).__module__].eager_attention_forward
        extra = {k: v for k, v in kwargs.items() if k not in (CTX_KW, "position_ids")}
        window = kwargs.get("sliding_window")
        out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
        pooled = self._pooled
        if pooled is not None:
            pooled.attend(out, query, self.pool.k[layer], self.pool.v[layer], scaling, window)
        for lane, (a, b) in zip(self._lanes, self._spans):
            if pooled is not None and lane in pooled.lanes:
                continue
            g, q = lane.group, b - a
            n = g.prefix_len + lane.length + q
            wk, wv = g.ws[layer]
            if lane.tail is not None:  # a shared group: this lane's tokens go after the prefix first
                tk, tv = lane.tail[layer]
                wk[0, :, g.prefix_len : n].copy_(tk[:, : n - g.prefix_len])
                wv[0, :, g.prefix_len : n].copy_(tv[:, : n - g.prefix_len])
            if q == 1 and self.decode_fast:
                out[0, a] = _decode_attention(query[0, :, a], wk[0, :, :n], wv[0, :, :n], scaling, window)
                continue
            o, _ = attention(module, query[:, :, a:b], wk[:, :, :n], wv[:, :, :n], self._mask(q, n - q, window),
                             scaling=scaling, position_ids=self._pos[:, a:b], **extra)
            out[0, a:b] = o[0]
        return out, None

    def _mask(self, q: int, past: int, window):
        key = (q, past, window)
        if key not in self._masks:
            self._masks[key] = single_mask(self.config, self.dtype, self.device, q, past, window)
        return self._masks[key]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling, window) -> torch.Tensor:
    """One query row per head, q [h, d], against k/v [kvh, n, d] (its last key is its own token);
    -> [h, d]. What SDPA computes for that row, in fp32: softmax(q k^T * scale) v over the keys it
    sees (the last ``window`` of them under a sliding window)."""
    h, d = q.shape
    kvh = k.shape[0]
    if window is not None and k.shape[1] > window:
        k, v = k[:, -window:], v[:, -window:]
    scale = scaling if scaling is not None else d**-0.5
    scores = torch.matmul(q.reshape(kvh, h // kvh, d), k.transpose(-1, -2)).mul_(scale)  # [kvh, g, n]
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(h, d)


class _PoolRows:
    """One step's decode rows whose lanes live in the ``LanePool``: they write and attend at once.

    Attention runs over the slot range the rows occupy, each row's keys masked past its own
    length (and before its window); slots in that range without a decode row this step get a
    zero query and see one key (no all-masked row, no NaN), and their output is dropped."""

    def __init__(self, rows: list, device):
        self.lanes = {lane for lane, _ in rows}
        slots = [lane.group.slot for lane, _ in rows]
        self.lo, hi = min(slots), max(slots) + 1
        self.rows = torch.tensor([a for _, a in rows], device=device)
        self.slots = torch.tensor(slots, device=device)
        self.rel = self.slots - self.lo
        # the new token's position in its slot, and how many keys each row sees (its own included)
        self.at = torch.tensor([lane.group.prefix_len + lane.length for lane, _ in rows], device=device)
        self.n = torch.ones(hi - self.lo, dtype=torch.long, device=device)
        self.n[self.rel] = self.at + 1
        self.width = int(self.n.max())
        self._masks: dict = {}  # window -> additive mask [slots, 1, 1, width], built once per step

    def write(self, pool_t: torch.Tensor, states: torch.Tensor) -> None:
        """states [1, kvh, rows, d]: each decode row's K (or V) at its position in its slot."""
        pool_t[self.slots, :, self.at] = states[0, :, self.rows].transpose(0, 1)

    def mask(self, window, dtype):
        if window not in self._masks:
            j = torch.arange(self.width, device=self.n.device)
            n = self.n[:, None]
            seen = j < n
            if window is not None:
                seen &= j >= n - window
            m = torch.zeros(seen.shape, dtype=dtype, device=n.device).masked_fill_(~seen, float("-inf"))
            self._masks[window] = m[:, None, None, :]
        return self._masks[window]

    def attend(self, out, query, pool_k, pool_v, scaling, window) -> None:
        """``_decode_attention`` for every row at once; writes out[0, row] = [h, d]."""
        h, d = query.shape[1], query.shape[3]
        slots, (_, kvh, cap, _) = self.n.shape[0], pool_k.shape
        q = query.new_zeros((slots, h, d))
        q[self.rel] = query[0, :, self.rows].transpose(0, 1)
        # [slots * kvh, width, d] views: bmm reads them strided (a 4-D matmul would copy them)
        span = slice(self.lo * kvh, (self.lo + slots) * kvh)
        k = pool_k.view(-1, cap, d)[span, : self.width]
        v = pool_v.view(-1, cap, d)[span, : self.width]
        scale = scaling if scaling is not None else d**-0.5
        scores = torch.bmm(q.view(slots * kvh, h // kvh, d), k.transpose(1, 2)).mul_(scale)
        scores = scores.view(slots, kvh, h // kvh, self.width).add_(self.mask(window, scores.dtype))
        o = torch.bmm(torch.softmax(scores, dim=-1).view(slots * kvh, h // kvh, self.width), v)
        out[0, self.rows] = o.view(slots, h, d)[self.rel]
