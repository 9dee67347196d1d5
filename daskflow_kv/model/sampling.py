"""Next-token choice: greedy by default, seeded sampling when asked.

A branch's generator is seeded from (seed, branch index), so a branch samples the same
tokens whether it runs alone, in a batch, or on another worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import validation


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept
    seed: int = 0  # reproducibility for temperature > 0

    def __post_init__(self):
        validation.number("temperature", self.temperature, minimum=0)
        validation.integer("top_k", self.top_k, minimum=0)
        validation.number("top_p", self.top_p, above=0, maximum=1)
        validation.integer("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self, stream: int = 0) -> torch.Generator | None:
        if self.greedy:
            return None
        return torch.Generator().manual_seed(self.seed * 1_000_003 + stream)


GREEDY = SamplingParams()


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token id from a 1-D logits vector."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > params.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
