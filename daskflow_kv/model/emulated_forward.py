"""A stand-in forward pass for the step loop: profiled step times, hash-chain tokens, real K/V bytes.

``EmulatedForward`` implements ``step_forward.StepForward`` for a model name
``emulated:<profile>``. The step loop above it is the real one (who joins, who feeds what,
chunked prefill, continuous batching); below it nothing computes: each ``run`` sleeps what
the profile (``emulated_profile``) prices the step's shape at - prompt tokens and the keys
they attend to, decode rows and their cached keys, prefixes loaded as requests joined - so
a worker process spends next to no CPU, and ``export`` cuts blocks that are real tensors of
the emulated model's byte size carrying the hash chain of their tokens (``emulated_kv``).

The tokens it emits are a function of every token before them (read from the prefix
blocks a request opened with, then chained over what it feeds), so state mode and text mode
still compare token for token, and a wrong prefix gives other tokens.
"""

from __future__ import annotations

import time

import torch

from ..state.blocks import aligned_floor, split_spans
from .emulated_kv import SEED, chain, hashes_in, make_kv, next_token
from .step_forward import Feed, StepForward


def sleep_until(deadline: float) -> None:
    """Sleep to ``deadline`` (a ``time.perf_counter()`` value); nothing if it has passed."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class Lane:
    """One request's K/V as the emulator keeps it: its chain values, nothing else."""

    __slots__ = ("first", "hashes", "h", "decoding")

    def __init__(self, first: int, hashes: list[int], h: int):
        self.first = first  # position of ``hashes[0]``: the aligned floor of its prefix
        self.hashes = hashes  # chain value of every position from ``first`` on
        self.h = h  # the chain value of its last position (SEED before any)
        self.decoding = False  # its prompt has ended (its last feed asked for logits)

    @property
    def length(self) -> int:
        return self.first + len(self.hashes)


class EmulatedForward(StepForward):
    """A profiled forward over ``runner`` (an ``emulated_runner.EmulatedRunner``)."""

    name = "emulated"

    def __init__(self, runner):
        self.runner = runner
        self.profile = runner.profile
        self.words = runner.words  # the tokens it may emit
        vocab = runner.vocab_size
        # one-hot logits without an allocation a row: row t is a view with its 1 at index t
        self._onehot = torch.zeros(2 * vocab, dtype=torch.float32)
        self._onehot[vocab] = 1.0
        self._joined = self._loaded = 0  # requests opened since the last step, prefix tokens they loaded

    def open(self, prefix_blocks, prefix_len, cap, group=None) -> Lane:
        first = aligned_floor(prefix_len, self.runner.block_size)
        known = hashes_in(prefix_blocks, max(first - 1, 0), prefix_len) if prefix_len else []
        h = known[-1] if known else SEED
        self._joined += 1
        self._loaded += prefix_len
        return Lane(first, known[len(known) - (prefix_len - first):] if prefix_len > first else [], h)

    def logits_for(self, token: int) -> torch.Tensor:
        vocab = self._onehot.numel() // 2
        return self._onehot[vocab - token : 2 * vocab - token]

    def run(self, feeds: list[Feed]) -> list[torch.Tensor | None]:
        t0 = time.perf_counter()
        shape = {"prompt_rows": 0, "prompt_tokens": 0, "prompt_attn": 0.0, "decode_rows": 0, "decode_keys": 0,
                 "joined": self._joined, "loaded_tokens": self._loaded}
        self._joined = self._loaded = 0
        out = []
        for f in feeds:
            lane, n = f.handle, len(f.tokens)
            if lane.decoding:
                shape["decode_rows"] += 1
                shape["decode_keys"] += lane.length
            else:
                shape["prompt_rows"] += 1
                shape["prompt_tokens"] += n
                shape["prompt_attn"] += n * (lane.length + n / 2)
            new = chain(lane.h, f.tokens)
            lane.hashes += new
            lane.h = new[-1]
            if f.logits:
                lane.decoding = True
                out.append(self.logits_for(next_token(lane.h, self.words)))
            else:
                out.append(None)
        sleep_until(t0 + self.profile.seconds(shape))
        return out

    def export(self, lane: Lane, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
        t0 = time.perf_counter()
        if start < lane.first or end > lane.length:
            raise ValueError(f"export [{start}, {end}) outside the lane's [{lane.first}, {lane.length})")
        rn = self.runner
        heads, dim = self.profile.stored_heads
        out = [(s, e, make_kv(rn.num_layers, heads, e - s, dim, rn.dtype, lane.hashes[s - lane.first : e - lane.first]))
               for s, e in split_spans(start, end, rn.block_size)]
        cost = self.profile.cost
        sleep_until(t0 + cost.per_finish + cost.per_exported * (end - start))
        return out

    def close(self, lane: Lane) -> None:
        pass
