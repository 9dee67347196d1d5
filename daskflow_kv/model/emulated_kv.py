"""What an emulated model computes: a hash chain over the tokens, carried in real K/V bytes.

An emulated engine (``emulated_forward``) has no weights, yet its outputs must still tell a
right prefix from a wrong one, or exactness would mean nothing: a resume from a wrong
prefix must give other tokens than text mode. So each position's "K/V" carries the state
of a hash chain over every token up to it,

    h(p) = mix(h(p - 1), token(p)),   h(-1) = SEED,

and the token after position p is a function of h(p) alone. A resume reads h(prefix - 1)
from the prefix's last block - the bytes Dask moved, spilled or read from the store - so it
continues the chain only if those bytes are the right ones.

In a block ``[layers, 2, heads, tokens, dim]`` the chain value of each position sits in the
first 8 bytes of layer 0's keys, head 0; every other byte is pseudo-random (drawn from one
pool per process, so transports cannot compress it, and cheap to fill).

Generated tokens come from the tokenizer's plain words (" the", " model", ...) that come
back as themselves when text is encoded again, as a real model's answers mostly do: an
agent that follows another then reuses its whole continuation, as with a real model.
"""

from __future__ import annotations

import functools
import re

import torch

SEED = 0x243F6A8885A308D3  # h(-1): the chain before any token
_MASK = (1 << 64) - 1
_POOL_BYTES = 8 << 20  # the per-process pool blocks draw their filler bytes from
_WORD = re.compile(r"^[a-z]{2,12}$")


def mix(h: int, token: int) -> int:
    """h(p) from h(p - 1) and token(p): splitmix64 of the two."""
    z = (h ^ ((token + 1) * 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def chain(h: int, tokens) -> list[int]:
    """h after each of ``tokens``, starting from ``h``."""
    out = []
    for t in tokens:
        h = mix(h, int(t))
        out.append(h)
    return out


@functools.lru_cache(maxsize=4)
def word_tokens(tokenizer) -> tuple[int, ...]:
    """Token ids of lower-case words with a leading space that encode back to themselves alone."""
    out = []
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if text.startswith(" ") and _WORD.match(text[1:]) and \
                tokenizer(text, add_special_tokens=False)["input_ids"] == [tid]:
            out.append(tid)
    if len(out) < 16:
        raise ValueError(f"the tokenizer has only {len(out)} plain word tokens; an emulated model needs >= 16")
    return tuple(out)


def next_token(h: int, words: tuple[int, ...]) -> int:
    """The token an emulated model emits after a position whose chain value is ``h``."""
    return words[(h >> 17) % len(words)]


@functools.lru_cache(maxsize=1)
def _pool() -> torch.Tensor:
    return torch.randint(0, 256, (_POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(53))


def _words(t: torch.Tensor) -> torch.Tensor:
    """``[tokens, dim]`` K rows (contiguous in dim) as int32 words: the chain's slots."""
    return t.view(torch.int32)


def make_kv(layers: int, heads: int, tokens: int, dim: int, dtype: torch.dtype, hashes: list[int]) -> torch.Tensor:
    """A block ``[layers, 2, heads, tokens, dim]`` of filler bytes carrying ``hashes``, one per token."""
    out = torch.empty((layers, 2, heads, tokens, dim), dtype=dtype)
    flat = out.view(-1).view(torch.uint8)
    pool, n = _pool(), flat.numel()
    at = (hashes[0] if hashes else 0) % (_POOL_BYTES // 2)  # blocks differ, yet cost one memcpy each
    done = 0
    while done < n:
        take = min(n - done, _POOL_BYTES - at)
        flat[done : done + take].copy_(pool[at : at + take])
        done, at = done + take, 0
    write_hashes(out[0, 0, 0], hashes)
    return out


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def write_hashes(rows: torch.Tensor, hashes: list[int]) -> None:
    """Put ``hashes`` into K rows ``[tokens, dim]``: two int32 words at the start of each row."""
    if hashes:
        words = _words(rows)
        words[:, 0] = torch.tensor([_signed(h & 0xFFFFFFFF) for h in hashes], dtype=torch.int32)
        words[:, 1] = torch.tensor([_signed(h >> 32) for h in hashes], dtype=torch.int32)


def read_hashes(rows: torch.Tensor) -> list[int]:
    """The chain values K rows ``[tokens, dim]`` carry (``write_hashes``' inverse)."""
    words = _words(rows.contiguous())[:, :2].to(torch.int64) & 0xFFFFFFFF
    return [int(lo) | int(hi) << 32 for lo, hi in words.tolist()]


def hashes_in(blocks: list[torch.Tensor], start: int, end: int) -> list[int]:
    """Chain values of positions [start, end) read from ``blocks`` (consecutive from position 0)."""
    out, pos = [], 0
    for b in blocks:
        n = b.shape[3]
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out += read_hashes(b[0, 0, 0, lo - pos : hi - pos])
        pos += n
        if pos >= end:
            break
    if len(out) != end - start:
        raise ValueError(f"prefix blocks hold fewer than the {end} tokens asked for")
    return out
