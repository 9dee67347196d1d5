"""Attention of a relayed chunk: earlier chunks' keys unmasked, its own keys causal, merged exactly.

The queries of chunk i attend to every key of the chunks before it and causally to their
own. As one call with an explicit mask, SDPA on CPU leaves its flash kernel for the masked
path (measured for SmolLM2's shapes, 1,216 queries after 2,880 keys: 1.5x the time of the
two parts below). Split in two, each part runs the flash kernel - the earlier keys with no
mask, the own keys with ``is_causal`` - and the partial results are merged by their
log-sum-exp, as flash attention merges its tiles: the same softmax, rounded differently
only in the last fp32 bits (the order of a sum), like any change of kernel tiling.

Only fp32 on CPU takes this path. bf16/fp16 keep the position-invariant exact kernel
(``attention.py``), whose rounding is what makes resumes match text mode; sliding windows,
soft-capping and other devices keep the model's own kernel. The model runs it through a
twin that shares every tensor with the loaded model (as batched resume does), so no other
forward in the process sees a different kernel.
"""

from __future__ import annotations

import copy
import itertools
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

RELAY_ATTENTION = "daskflow_relay"
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # returns (out, lse)
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TWIN_LOCK = threading.Lock()


def split_attention(query, key, value, scale: float) -> torch.Tensor:
    """query [b, h, q, d] at the last q of the k positions of key/value [b, kvh, k, d]."""
    b, h, q, d = query.shape
    kvh, past = key.shape[1], key.shape[-2] - query.shape[-2]
    g = h // kvh
    # earlier chunks: no mask, so the g query heads of one kv head run as one (no K/V copy)
    o1, l1 = _FLASH(query.reshape(b, kvh, g * q, d), key[:, :, :past], value[:, :, :past], 0.0, False, scale=scale)
    o2, l2 = _FLASH(query, repeat_kv(key[:, :, past:], g), repeat_kv(value[:, :, past:], g), 0.0, True, scale=scale)
    o1, l1 = o1.reshape(b, h, q, d), l1.reshape(b, h, q)
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)


def relay_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    past = key.shape[-2] - query.shape[-2]
    plain = kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
    if _FLASH is None or past <= 0 or not plain or query.device.type != "cpu" or query.dtype != torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return split_attention(query, key, value, scale).transpose(1, 2).contiguous(), None


def relay_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` running ``relay_attention`` (fp32 SDPA models only; others are returned as they are)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if cfg._attn_implementation != "sdpa":
        return model
    with _TWIN_LOCK:
        twin = _TWINS.get(model)
        if twin is None:
            AttentionInterface.register(RELAY_ATTENTION, relay_attention)
            AttentionMaskInterface.register(RELAY_ATTENTION, sdpa_mask)
            memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
            twin = copy.deepcopy(model, memo)
            twin.config._attn_implementation = RELAY_ATTENTION
            _TWINS[model] = twin
        return twin
