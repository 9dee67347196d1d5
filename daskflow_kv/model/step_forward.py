"""The one boundary between the step loop and the forward pass: ``StepForward``.

The step loop (``step_engine.StepEngine``) decides, every step, which requests feed which
tokens (``policy.step_schedule``); a ``StepForward`` turns that into K/V and logits. The
loop never touches a model, a cache or a tensor of K/V: it only calls, per request,

* ``open(prefix_blocks, prefix_len, cap, group)`` when it joins -> a handle. KV write: the
  first ``prefix_len`` tokens of ``prefix_blocks`` ([layers, 2, kvh, t, d] each) are loaded,
  room is made for ``cap`` more tokens. ``group`` (hashable, or None): requests opened with
  the same group continue one prefix (the forks of one state) and may hold it once;
* ``run(feeds)`` once per step: every ``Feed`` (handle, the tokens it feeds now at its next
  positions, whether its last row's logits are wanted) in one forward -> a list, per feed,
  of the last row's fp32 logits ``[vocab]`` or None;
* ``export(handle, start, end)`` when it finishes -> blocks ``(s, e, [layers, 2, kvh, t, d])``
  of positions [start, end) cut at ``block_size`` boundaries (KV read), and ``close(handle)``.

and reads ``solo_reason`` (why requests never share a forward, or None) and ``align``
(prompt chunks must end on multiples of it, 0: anywhere) for its schedule, and
``pooled_shape`` (what the last step's pooled attention covered) for ``StepShape``.

Implementations: ``SoloForward`` (each request its own ``ModelRunner`` forwards: below
fp32, or attention the packed step cannot reproduce), ``packed_forward.PackedForward``
(every request's rows in one forward; its network is the hand-written Llama-family step,
``llama_forward.LlamaNet``, where the architecture is one it knows, else the model's own
transformers forward). An emulated engine (a profiled step time, deterministic tokens)
implements the same calls. ``packed_forward.forward_for`` picks one for a runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

FORWARDS = ("auto", "hf")  # batching.forward: auto (hand-written step where known) | hf (transformers' forward)


@dataclass(slots=True)
class Feed:
    """What one request feeds in one step."""

    handle: object  # what ``open`` returned for it
    tokens: list[int]  # fed at its next positions
    logits: bool  # is its last row's logits wanted (its prompt ends, or it decodes)


class StepForward(ABC):
    """A forward pass the step loop drives: see the module docstring."""

    solo_reason: str | None = None  # why requests run in their own rows (None: they share one forward)
    align: int = 0  # prompt chunks end on multiples of this (0: anywhere)
    pooled_shape: tuple[int, int, int] = (0, 0, 0)  # last step: decode rows attended at once, slots, keys each
    name: str = ""  # which forward this is (benchmarks and logs)

    @abstractmethod
    def open(self, prefix_blocks: list, prefix_len: int, cap: int, group=None) -> object: ...

    @abstractmethod
    def run(self, feeds: list[Feed]) -> list[torch.Tensor | None]: ...

    @abstractmethod
    def export(self, handle, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]: ...

    @abstractmethod
    def close(self, handle) -> None: ...


class SoloForward(StepForward):
    """Each request's own forwards through ``ModelRunner``: the chunks ``run`` would feed, so
    its tokens and K/V are bit-identical to a single run's."""

    name = "solo"

    def __init__(self, runner, reason: str):
        self.runner = runner
        self.solo_reason = reason
        self.align = runner.block_size if runner.aligned_prefill else 0

    def open(self, prefix_blocks, prefix_len, cap, group=None):
        return self.runner.open_cache(prefix_blocks, prefix_len, prefix_len + cap + 1)

    def run(self, feeds):
        return [self.runner.feed(f.handle, f.tokens) for f in feeds]

    def export(self, handle, start, end):
        return self.runner.export_blocks(handle, start, end)

    def close(self, handle) -> None:
        pass
