"""Every request's rows of a step in one forward: ``PackedForward`` (a ``StepForward``).

The rows of all requests are packed into one sequence, each with its own position, so the
weight matmuls run once for all of them while attention stays per request: K/V live in
the ``step_cache`` (a lane per request, a group per shared prefix, solo lanes in the
``LanePool``). The network that runs the packed rows is one of two, both reading and
writing K/V through that cache (``StepCache.update`` / ``attend``):

* ``llama_forward.LlamaNet``: a hand-written Llama-family step over the model's own weights
  (fused QKV and gate-up matmuls, few ops per layer), for the architectures it knows;
* ``HFNet``: the model's own transformers forward on its ``batched_twin``, for any other
  architecture whose attention ``step_cache`` reproduces.
"""

from __future__ import annotations

import torch

from ..state.blocks import split_spans
from .batched import batched_twin
from .batched_cache import CTX_KW, unsupported_layers
from .lane_pool import LanePool
from .llama_forward import llama_net, llama_reason
from .step_cache import Group, Lane, StepCache
from .step_forward import FORWARDS, Feed, SoloForward, StepForward

_READY_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)  # a 4-D mask: transformers builds none


class HFNet:
    """The packed rows through the model's own forward (its twin with the batched kernel)."""

    name = "hf"

    def __init__(self, model):
        self.twin = batched_twin(model)

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, cache: StepCache, keep: list[int]):
        dev = ids.device
        out = self.twin(input_ids=ids[None], position_ids=position_ids, attention_mask=_READY_MASK.to(dev),
                        cache=cache, use_cache=True, logits_to_keep=torch.tensor(keep, device=dev), **{CTX_KW: cache})
        return out.logits[0].float()


class PackedForward(StepForward):
    """Packed rows over a ``StepCache``; ``net`` runs them (``LlamaNet`` or ``HFNet``)."""

    def __init__(self, runner, net, pool_bytes: int, why_not_fast: str | None = None):
        self.runner = runner
        self.net = net
        self.name = f"packed-{net.name}"
        self.why_not_fast = why_not_fast  # why the hand-written step does not run this model (None: it does)
        cfg = runner.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.cache = StepCache(cfg, runner.dtype, runner.device)
        if self.cache.decode_fast:  # its decode rows can attend at once: solo groups live in one pool
            self.cache.pool = LanePool(runner.num_layers, runner.kv_heads, runner.head_dim, runner.dtype,
                                       runner.device, pool_bytes)
        self._groups: dict[object, Group] = {}  # shared groups by the caller's key, while a lane runs

    def open(self, prefix_blocks, prefix_len, cap, group=None) -> Lane:
        rn = self.runner
        g = self._groups.get(group) if group is not None else None
        if g is None:
            pool = self.cache.pool
            pooled = group is None and pool is not None and pool.accepts(prefix_len + cap)
            g = Group(rn.num_layers, rn.kv_heads, rn.head_dim, prefix_len, cap, group is not None, rn.dtype,
                      rn.device, pool if pooled else None)
            try:
                g.load_prefix(prefix_blocks)
            except Exception:
                if g.slot is not None:  # a bad prefix must not keep its pool slot
                    pool.release(g)
                raise
            if group is not None:
                self._groups[group] = g
        g.fit(cap)
        lane = Lane(g, cap, rn.kv_heads, rn.head_dim, rn.dtype, rn.device)
        g.lanes.append(lane)
        return lane

    def run(self, feeds: list[Feed]) -> list[torch.Tensor | None]:
        dev = self.runner.device
        ids, pos, want = [], [], []
        for f in feeds:
            start = f.handle.group.prefix_len + f.handle.length
            ids += f.tokens
            pos += range(start, start + len(f.tokens))
            want.append(len(ids) - 1 if f.logits else None)
        keep = sorted(i for i in want if i is not None) or [len(ids) - 1]
        position_ids = torch.tensor([pos], dtype=torch.long, device=dev)
        cache = self.cache
        cache.begin([f.handle for f in feeds], [len(f.tokens) for f in feeds], position_ids)
        try:
            rows = self.net(torch.tensor(ids, dtype=torch.long, device=dev), position_ids, cache, keep)
        finally:
            self.pooled_shape = cache.pooled_shape
            cache.end()
        at = {i: j for j, i in enumerate(keep)}
        return [None if i is None else rows[at[i]] for i in want]

    def export(self, lane: Lane, start: int, end: int):
        rn = self.runner
        return [(s, e, torch.stack([torch.stack(lane.kv(layer, s, e)) for layer in range(rn.num_layers)]).contiguous())
                for s, e in split_spans(start, end, rn.block_size)]

    def close(self, lane: Lane) -> None:
        g = lane.group
        if lane in g.lanes:
            g.lanes.remove(lane)
        if g.lanes:
            return
        if g.slot is not None:  # after the export read its K/V: a pooled group's slot goes back
            self.cache.pool.release(g)
        for key in [k for k, v in self._groups.items() if v is g]:
            del self._groups[key]


def forward_for(runner, pool_bytes: int, forward: str = "auto") -> StepForward:
    """The forward a step loop over ``runner`` uses: solo where rows cannot share a forward
    exactly, else packed rows through the hand-written step (``forward="auto"`` and an
    architecture ``llama_forward`` knows) or through the model's own forward; a runner's own
    forward where it has one (an emulated model's)."""
    if forward not in FORWARDS:
        raise ValueError(f"batching.forward={forward!r}; expected one of {FORWARDS}")
    if hasattr(runner, "step_forward"):  # a runner that brings its own (emulated_runner.EmulatedRunner)
        return runner.step_forward()
    cfg = runner.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    reason = ("prefill below fp32 is fed in block-aligned chunks of its own" if runner.aligned_prefill
              else unsupported_layers(cfg))
    if reason:
        return SoloForward(runner, reason)
    why_not = "batching.forward=hf" if forward == "hf" else llama_reason(runner.model)
    net = HFNet(runner.model) if why_not else llama_net(runner.model)
    return PackedForward(runner, net, pool_bytes, why_not)
