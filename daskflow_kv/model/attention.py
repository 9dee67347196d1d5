"""Position-invariant attention, so that resuming from a cache is bit-compatible with text mode.

Low-precision attention kernels (bf16/fp16 SDPA on CPU, flash kernels on GPU) choose their
tiling from the query and key lengths and use an ``is_causal`` shortcut for full prefill,
so the same query row rounds differently when it is computed in one full prefill (text
mode) or as part of a suffix prefill over a cache (state mode). In bf16 that flips greedy
tokens. This kernel computes every query row the same way whatever the batch of queries
around it: fp32 scores against all keys, an explicit boolean mask, fp32 softmax, fp32
weighted sum, one rounding to the model dtype at the end. fp32 models keep SDPA, whose
differences are ~1e-7 relative and do not flip tokens.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT_ATTENTION = "daskflow_exact"
_QUERY_CHUNK = 256  # bounds the fp32 score matrix to heads x 256 x keys


def _exact_mask(*args, **kwargs):
    # Always an explicit mask: the is_causal skip would send full prefill down another path.
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """query [b, h, q, d], key/value [b, kvh, k, d], mask bool [b, 1, q, k] (True = attend).

    ``softcap``: Gemma-2-style logit soft-capping, applied as transformers' eager kernel
    does. Sliding windows need nothing here: they are in the mask.
    """
    b, h, q_len, d = query.shape
    kvh = key.shape[1]
    groups = h // kvh
    scale = scaling if scaling is not None else d**-0.5
    k32 = key.float().transpose(-1, -2)  # [b, kvh, d, k]
    v32 = value.float()
    out = torch.empty((b, h, q_len, value.shape[-1]), dtype=query.dtype, device=query.device)
    for start in range(0, q_len, _QUERY_CHUNK):
        stop = min(q_len, start + _QUERY_CHUNK)
        q32 = query[:, :, start:stop].float().reshape(b, kvh, groups * (stop - start), d)
        scores = torch.matmul(q32, k32).mul_(scale).reshape(b, h, stop - start, -1)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            mask = attention_mask[:, :, start:stop]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.float()
        probs = torch.softmax(scores, dim=-1).reshape(b, kvh, groups * (stop - start), -1)
        ctx = torch.matmul(probs, v32).reshape(b, h, stop - start, -1)
        out[:, :, start:stop] = ctx.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_exact_attention() -> str:
    """Register the kernel with transformers (idempotent) and return its name."""
    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)
    return EXACT_ATTENTION


def attention_for(dtype: torch.dtype) -> str:
    """The attention implementation a model of ``dtype`` runs with in both modes."""
    return "sdpa" if dtype == torch.float32 else register_exact_attention()
