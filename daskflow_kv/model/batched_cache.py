"""One prefix, k branch tails: the cache and the attention kernel behind batched resume.

``SharedPrefixCache`` holds a forked state's prefix K/V once and every branch's own tokens
(its suffix and what it generated) in one flat, ragged pool per layer: branch b owns
``pool[:, off[b] : off[b] + cap[b]]`` with ``cap[b]`` = exactly the tokens it will feed, so
memory is prefix + the sum of the branch tails, with no padding and no k-fold prefix copy.

``batched_attention`` is registered with transformers (``AttentionInterface``) and reads
the prefix and the tails from the cache handed to it in the forward's kwargs. Two ways:

replay (default) - each branch's query rows go through the model's own attention kernel
    (``daskflow_exact`` in bf16, SDPA in fp32) over a [prefix | own tail] key view of a
    workspace that holds the prefix once per layer: same function, same shapes, same mask as
    a single-branch resume, so attention is bit-identical to it by construction. Attention
    FLOPs are those of k single resumes; the weight passes are batched.
shared - all branches' queries hit the prefix in one matmul (the prefix is read once per
    step), each branch's tail in a padded bmm, and the two parts are merged by log-sum-exp
    in fp32. Exact in real arithmetic, but it rounds differently from the single-row kernel:
    fine in fp32, while in bf16 a near-tie can flip a greedy token (seen on tiny-qwen2).

What no batching can make bit-identical is the weight matmuls: a k-row GEMM may round
differently from the one-row GEMV of a single decode step (measured on this CPU: fp32 rows
differ by ~1e-6 relative; bf16 about one element in 64,000 by one ulp). That is the same
class of difference as text mode (one long prefill) vs state mode (a suffix prefill).
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import EXACT_ATTENTION

BATCHED_ATTENTION = "daskflow_batched"
CTX_KW = "daskflow_batch"  # forward kwarg carrying the SharedPrefixCache to the kernel
MODES = ("replay", "shared")
# Per-layer attention patterns batched resume reproduces. A layer says which it is by the
# ``sliding_window`` it passes to its attention kernel (None: full causal attention).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_layers(config) -> str | None:
    """Why batched resume cannot reproduce ``config``'s attention, or None when it can.

    Callers check this before they batch (the runtime then resumes branch by branch), so an
    unsupported model never fails inside a worker.
    """
    types = set(getattr(config, "layer_types", None) or ())
    odd = sorted(types - set(SUPPORTED_LAYER_TYPES))
    if odd:
        return f"layer types {odd} (batched resume reproduces {list(SUPPORTED_LAYER_TYPES)})"
    return None


class _PastLength:
    """Stands in for a single-branch cache of ``n`` tokens when asking transformers for a mask."""

    is_compileable = False

    def __init__(self, n: int):
        self.n = n

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.n + query_length, 0


def single_mask(config, dtype, device, q_len: int, past: int, sliding_window: int | None):
    """The mask a single-request forward of ``q_len`` queries after ``past`` cached tokens
    gets from transformers, for full attention or a sliding window of ``sliding_window``."""
    probe = torch.empty((1, q_len, 1), dtype=dtype, device=device)
    pos = torch.arange(past, past + q_len, device=device).unsqueeze(0)
    make = create_causal_mask if sliding_window is None else create_sliding_window_causal_mask
    if sliding_window is not None and getattr(config, "sliding_window", None) != sliding_window:
        config = copy.copy(config)  # the layer's own window, if the config names another
        config.sliding_window = sliding_window
    return make(config=config, inputs_embeds=probe, attention_mask=None, cache=_PastLength(past), position_ids=pos)


class SharedPrefixCache:
    """Prefix K/V once ([1, kvh, P, d] per layer) plus a ragged tail pool per layer."""

    def __init__(self, config, prefix_len, tail_caps, kv_heads, head_dim, dtype, device, mode="replay"):
        if mode not in MODES:
            raise ValueError(f"attention mode {mode!r}; expected one of {MODES}")
        self.config = config  # the ORIGINAL model config: its attention kernel and mask are replayed
        self.mode = mode  # replay | shared
        self.prefix_len = prefix_len  # P, tokens shared by every branch
        self.caps = list(tail_caps)  # tokens each branch will feed (suffix + generated - 1)
        self.offsets = [sum(self.caps[:b]) for b in range(len(self.caps))]  # branch start in the pool
        self.lens = [0] * len(self.caps)  # tokens each branch has in the pool
        self.dtype, self.device = dtype, device
        self.orig_attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)  # None: eager
        # The exact kernel works in fp32: give it fp32 keys so it does not convert per branch.
        exact = config._attn_implementation == EXACT_ATTENTION
        self.work_dtype = torch.float32 if exact and mode == "replay" else dtype
        t_max, P = max(self.caps, default=0), prefix_len
        n_layers = config.num_hidden_layers
        own_ws = mode == "replay" and self.work_dtype == dtype  # prefix lives in the workspace itself
        shape = (1, kv_heads, P + (t_max if own_ws else 0), head_dim)
        pool = (kv_heads, sum(self.caps), head_dim)
        self.prefix = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]  # [1, kvh, P(+T), d]; [:P] is the prefix
        self.pool = [
            (torch.empty(pool, dtype=dtype, device=device), torch.empty(pool, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]  # [kvh, sum(caps), d]
        self.scratch = None  # one fp32 [1, kvh, P + T, d] K/V pair shared by all layers (bf16 replay)
        if mode == "replay" and not own_ws:
            ws = (1, kv_heads, P + t_max, head_dim)
            self.scratch = (
                torch.empty(ws, dtype=self.work_dtype, device=device),
                torch.empty(ws, dtype=self.work_dtype, device=device),
            )
        elem = torch.finfo(dtype).bits // 8
        self.kv_bytes = sum(t.numel() * elem for pair in self.prefix + self.pool for t in pair)  # held K/V
        self.scratch_bytes = sum(t.numel() * t.element_size() for t in self.scratch) if self.scratch else 0
        self._step = None  # per-forward plan, set by begin_step

    # -- loading and export ------------------------------------------------------------------
    def load_prefix(self, blocks: list[torch.Tensor]) -> None:
        """Copy the first P tokens of ``blocks`` ([layers, 2, kvh, t, d] each) into the prefix."""
        pos = 0
        for block in blocks:
            take = min(block.shape[3], self.prefix_len - pos)
            if take <= 0:
                break
            block = block.to(self.device, non_blocking=True)
            for (k, v), layer in zip(self.prefix, block):
                k[0, :, pos : pos + take].copy_(layer[0, :, :take])
                v[0, :, pos : pos + take].copy_(layer[1, :, :take])
            pos += take
        if pos < self.prefix_len:
            raise ValueError(f"prefix blocks hold {pos} tokens, fewer than the {self.prefix_len} asked for")

    def branch_kv(self, layer: int, b: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Branch b's K/V for absolute positions [start, end) as [kvh, end - start, d]."""
        P, off = self.prefix_len, self.offsets[b]
        (pk, pv), (tk, tv) = self.prefix[layer], self.pool[layer]
        parts_k, parts_v = [], []
        if start < P:
            parts_k.append(pk[0, :, start : min(end, P)])
            parts_v.append(pv[0, :, start : min(end, P)])
        if end > P:
            s = max(start, P) - P
            parts_k.append(tk[:, off + s : off + end - P])
            parts_v.append(tv[:, off + s : off + end - P])
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    # -- one forward -------------------------------------------------------------------------
    def begin_step(self, active: list[int], q_lens: list[int], width: int, position_ids: torch.Tensor) -> None:
        """Plan a forward of ``width`` left-padded query rows for the ``active`` branches."""
        dev = self.device
        src, dst = [], []
        for j, (b, q) in enumerate(zip(active, q_lens)):
            if self.lens[b] + q > self.caps[b]:
                raise RuntimeError(f"branch {b} would exceed its tail capacity {self.caps[b]}")
            src.extend(j * width + t for t in range(width - q, width))
            dst.extend(range(self.offsets[b] + self.lens[b], self.offsets[b] + self.lens[b] + q))
        dense = len(src) == len(active) * width
        step = {
            "active": active,
            "q_lens": q_lens,
            "width": width,
            "position_ids": position_ids,
            "src": None if dense else torch.tensor(src, device=dev),
            "dst": torch.tensor(dst, device=dev),
            "new_lens": [self.lens[b] + q for b, q in zip(active, q_lens)],
        }
        if self.mode == "shared":
            step.update(self._shared_plan(active, q_lens, width))
        self._step = step

    def _masks(self, sliding_window: int | None) -> list:
        """Replay: the mask each active branch would get from a single-branch resume, per
        attention pattern (full, or sliding over ``sliding_window`` keys), built once per step."""
        st = self._step
        masks = st.setdefault("masks", {})
        if sliding_window not in masks:
            masks[sliding_window] = [
                self._single_mask(q, self.prefix_len + self.lens[b], sliding_window)
                for b, q in zip(st["active"], st["q_lens"])
            ]
        return masks[sliding_window]

    def end_step(self) -> None:
        for b, n in zip(self._step["active"], self._step["new_lens"]):
            self.lens[b] = n
        self._step = None

    def _single_mask(self, q_len: int, past: int, sliding_window: int | None):
        return single_mask(self.config, self.dtype, self.device, q_len, past, sliding_window)

    def _shared_plan(self, active, q_lens, width):
        n_max = max(self.lens[b] + q for b, q in zip(active, q_lens))
        lens_after = torch.tensor([self.lens[b] + q for b, q in zip(active, q_lens)], device=self.device)
        offs = torch.tensor([self.offsets[b] for b in active], device=self.device)
        key_pos = torch.arange(n_max, device=self.device)
        # query row t of branch j sits at tail offset lens_after[j] - width + t (left padding)
        q_pos = lens_after[:, None] - width + torch.arange(width, device=self.device)[None, :]
        visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens_after[:, None, None])
        # pool slot of each (branch, key); padding keys point at the branch's first slot (masked)
        gather = torch.where(key_pos[None, :] < lens_after[:, None], offs[:, None] + key_pos[None, :], offs[:, None])
        return {"n_max": n_max, "visible": visible, "gather": gather.reshape(-1), "q_pos": q_pos}

    # -- transformers cache protocol ---------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the real (unpadded) rows of this step's K/V into each branch's tail."""
        st = self._step
        for new, buf in zip((key_states, value_states), self.pool[layer_idx]):
            a, kvh, q, d = new.shape
            rows = new.transpose(0, 1).reshape(kvh, a * q, d)
            if st["src"] is not None:
                rows = rows.index_select(1, st["src"])
            buf.index_copy_(1, st["dst"], rows)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_len + max(self.lens, default=0)

    # -- attention ---------------------------------------------------------------------------
    def attend(self, module, query, scaling, kwargs):
        if self.mode == "replay":
            return self._attend_replay(module, query, scaling, kwargs)
        return self._attend_shared(module, query, scaling, kwargs.get("sliding_window"), kwargs.get("softcap"))

    def _attend_replay(self, module, query, scaling, kwargs):
        st, P = self._step, self.prefix_len
        layer = module.layer_idx
        (pk, pv), (tk, tv) = self.prefix[layer], self.pool[layer]
        if self.scratch is not None:  # bf16: convert the prefix to fp32 once per layer, for all branches
            wk, wv = self.scratch
            wk[:, :, :P].copy_(pk)
            wv[:, :, :P].copy_(pv)
        else:
            wk, wv = pk, pv
        attention = self.orig_attention or sys.modules[type(module).__module__].eager_attention_forward
        a, h, width, d = query.shape
        out = query.new_zeros((a, width, h, d))
        extra = {k: v for k, v in kwargs.items() if k not in (CTX_KW, "position_ids")}
        masks = self._masks(kwargs.get("sliding_window"))
        for j, (b, q, n) in enumerate(zip(st["active"], st["q_lens"], st["new_lens"])):
            off = self.offsets[b]
            wk[0, :, P : P + n].copy_(tk[:, off : off + n])
            wv[0, :, P : P + n].copy_(tv[:, off : off + n])
            o, _ = attention(
                module,
                query[j : j + 1, :, width - q :],
                wk[:, :, : P + n],
                wv[:, :, : P + n],
                masks[j],
                scaling=scaling,
                position_ids=st["position_ids"][j : j + 1, width - q :],
                **extra,
            )
            out[j, width - q :] = o[0]
        return out, None

    def _attend_shared(self, module, query, scaling, sliding_window=None, softcap=None):
        st, P = self._step, self.prefix_len
        layer = module.layer_idx
        (pk, pv), (tk, tv) = self.prefix[layer], self.pool[layer]
        a, h, w, d = query.shape
        kvh = pk.shape[1]
        g = h // kvh
        scale = scaling if scaling is not None else d**-0.5
        neg = float("-inf")
        q32 = query.float().reshape(a, kvh, g * w, d)  # [a, kvh, g*w, d]
        n_max, q_pos = st["n_max"], st["q_pos"]  # q_pos: [a, w] tail offset of each query row
        # tail part: each branch against its own (padded) tail
        kt = tk.index_select(1, st["gather"]).float().reshape(kvh, a, n_max, d).transpose(0, 1)
        vt = tv.index_select(1, st["gather"]).float().reshape(kvh, a, n_max, d).transpose(0, 1)
        s_t = _softcapped(torch.matmul(q32, kt.transpose(-1, -2)).mul_(scale), softcap).reshape(a, kvh, g, w, n_max)
        visible = st["visible"]
        if sliding_window is not None:  # a key is seen only within the window behind its query
            key_pos = torch.arange(n_max, device=self.device)
            visible = visible & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
        s_t = s_t.masked_fill(~visible[:, None, None], neg).reshape(a, kvh, g * w, n_max)
        m = s_t.amax(-1, keepdim=True)  # [a, kvh, g*w, 1]
        if P:
            # prefix part: every query row of every branch in one matmul; the prefix is read once
            qp = q32.transpose(0, 1).reshape(kvh, a * g * w, d)
            s_p = _softcapped(torch.matmul(qp, pk[0].float().transpose(-1, -2)).mul_(scale), softcap)  # [kvh, a*g*w, P]
            if sliding_window is not None:  # prefix key p vs a query at absolute position P + q_pos
                seen = torch.arange(P, device=self.device)[None, None, :] > (P + q_pos[:, :, None] - sliding_window)
                seen = seen[:, None].expand(a, g, w, P).reshape(a * g * w, P)
                s_p = s_p.masked_fill(~seen[None], neg)
            m = torch.maximum(m, s_p.amax(-1, keepdim=True).reshape(kvh, a, g * w, 1).transpose(0, 1))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see nothing (padding)
        e_t = torch.exp(s_t - m)
        l = e_t.sum(-1, keepdim=True)
        o = torch.matmul(e_t, vt)
        if P:  # both parts against the same row maximum: a masked-out prefix adds exactly 0
            e_p = torch.exp(s_p - m.transpose(0, 1).reshape(kvh, a * g * w, 1))
            l = l + e_p.sum(-1, keepdim=True).reshape(kvh, a, g * w, 1).transpose(0, 1)
            o = o + torch.matmul(e_p, pv[0].float()).reshape(kvh, a, g * w, d).transpose(0, 1)
        o = torch.nan_to_num(o / l)  # [a, kvh, g*w, d]
        return o.reshape(a, h, w, d).to(query.dtype).transpose(1, 2).contiguous(), None


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2-style logit soft-capping (as transformers' eager kernel applies it)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def batched_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered kernel: query [b, h, q, d]; keys come from the cache in ``kwargs``."""
    cache = kwargs.get(CTX_KW)
    if cache is None:
        raise RuntimeError(f"{BATCHED_ATTENTION} needs the SharedPrefixCache passed as {CTX_KW}=")
    return cache.attend(module, query, scaling, kwargs)


def _no_mask(*args, **kwargs):
    return None  # masks are the cache's business; the forward also passes a ready 4-D mask


def register_batched_attention() -> str:
    """Register the kernel with transformers (idempotent) and return its name."""
    AttentionInterface.register(BATCHED_ATTENTION, batched_attention)
    AttentionMaskInterface.register(BATCHED_ATTENTION, _no_mask)
    return BATCHED_ATTENTION
