"""A hand-written Llama-family step over a transformers model's own weights: ``LlamaNet``.

A decode step of SmolLM2-135M through transformers' modules is ~1,000 small ops (modules,
hooks, masks, kwargs) around 211 weight matmuls, and each matmul of a few rows goes to
MKL's one-threaded GEMV (12 GB/s on this machine, against ~50 GB/s the memory reads).
``LlamaNet`` runs the same arithmetic in few ops per layer:

* q, k and v in one matmul, gate and up in one (the weights are concatenated once and the
  model's own parameters become views of them: no second copy of the weights);
* a matmul of at most ``FEW_ROWS`` rows on a CPU is split across the intra-op threads as a
  ``bmm`` over row blocks of the weight (MKL parallelizes the batch; measured on 2 cores:
  the whole model's matmuls for one row 44 -> 18 ms, for 8 rows 55 -> 39 ms);
* ``torch.rms_norm``, RoPE on q and k at once (cos/sin from the model's own rotary module,
  so every RoPE variant it supports is computed as it computes it), SiLU-and-multiply;
* K/V writes and attention through the step's ``StepCache`` exactly as the transformers
  path does them (``update`` / ``attend``: SDPA per lane, pooled decode rows at once);
* the final norm and the vocabulary head only for the rows whose logits are wanted.

The arithmetic is the model's own, rounded in another order (fused matmuls, the norm's
reduction): logits within 1e-4 of their scale of the transformers forward, greedy tokens
identical (``docs/exactness.md``, checked on every fp32 model the suite builds). Only the
architectures listed in ``FAMILIES`` run here, checked class by class (``llama_reason``);
any other model runs through its own forward (``packed_forward.HFNet``).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

FEW_ROWS = 32  # matmuls of at most this many rows run as a row-block bmm on a CPU (see module doc)

# model class -> (decoder layer, attention, MLP, norm class names, the sliding window a layer's attention uses)
FAMILIES = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm", lambda attn, cfg: None),
    "MistralForCausalLM": ("MistralDecoderLayer", "MistralAttention", "MistralMLP", "MistralRMSNorm",
                           lambda attn, cfg: getattr(cfg, "sliding_window", None)),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm",
                         lambda attn, cfg: attn.sliding_window),
}
_NETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LlamaNet (weights fused once)
_LOCK = threading.Lock()


def llama_reason(model) -> str | None:
    """Why ``LlamaNet`` cannot run ``model`` exactly as its own forward would, or None."""
    cls = type(model)
    if cls.__name__ not in FAMILIES or not cls.__module__.startswith("transformers.models."):
        return f"{cls.__module__}.{cls.__name__} is not one of the hand-written step's {sorted(FAMILIES)}"
    cfg = model.config
    layer_cls, attn_cls, mlp_cls, norm_cls, _ = FAMILIES[cls.__name__]
    if getattr(cfg, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (the hand-written step has SiLU)"
    for knob in ("pretraining_tp", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, knob, None) not in (None, 1):
            return f"config.{knob}={getattr(cfg, knob)!r}"
    if next(model.parameters()).dtype != torch.float32:
        return "the hand-written step runs fp32 models"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model has no embed_tokens / layers / norm / rotary_emb"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return "the vocabulary head is not a plain bias-free Linear"
    for i, layer in enumerate(inner.layers):
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = (type(layer).__name__, type(a).__name__, type(m).__name__, type(layer.input_layernorm).__name__,
                 type(layer.post_attention_layernorm).__name__)
        if names != (layer_cls, attn_cls, mlp_cls, norm_cls, norm_cls):
            return f"layer {i} is made of {names}"
        linears = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(lin) is not torch.nn.Linear for lin in linears):
            return f"layer {i}'s projections are not plain Linear modules"
    return None


def llama_net(model) -> "LlamaNet":
    """The model's ``LlamaNet``, made once per model (its weights fused once)."""
    with _LOCK:
        net = _NETS.get(model)
        if net is None:
            reason = llama_reason(model)
            if reason:
                raise NotImplementedError(f"the hand-written step cannot run this model: {reason}")
            net = _NETS[model] = LlamaNet(model)
        return net


class _Linear:
    """``x @ w.T + b`` for a weight [n, k]; few rows on a CPU as a bmm over row blocks of ``w``."""

    __slots__ = ("w", "b", "n", "k", "_blocks")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.w, self.b = w, b
        self.n, self.k = w.shape
        self._blocks: dict[int, torch.Tensor] = {}  # parts -> w viewed as [parts, n / parts, k]

    def __call__(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        rows = x.shape[0]
        if parts < 2 or rows > FEW_ROWS or self.n % parts:
            return F.linear(x, self.w, self.b)
        wb = self._blocks.get(parts)
        if wb is None:
            wb = self._blocks[parts] = self.w.view(parts, self.n // parts, self.k)
        y = torch.bmm(wb, x.t().expand(parts, self.k, rows)).view(self.n, rows).t()  # [rows, n]
        if rows > 1:
            y = y.contiguous()
        return y if self.b is None else y.add_(self.b)


def _fused(linears: list[torch.nn.Module]) -> _Linear:
    """One matmul for several projections of the same input: their weights concatenated once,
    each module's own weight (and bias) then a view of the fused tensor, so nothing is copied
    twice and the model's own forward reads the same numbers."""
    with torch.no_grad():
        w = torch.cat([lin.weight for lin in linears]).contiguous()
        b = None
        if any(lin.bias is not None for lin in linears):
            b = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                           for lin in linears]).contiguous()
        at = 0
        for lin in linears:
            n = lin.out_features
            lin.weight.data = w[at : at + n]
            if lin.bias is not None:
                lin.bias.data = b[at : at + n]
            at += n
    return _Linear(w, b)


class _Layer:
    __slots__ = ("attn", "norm1", "eps1", "norm2", "eps2", "qkv", "o", "gate_up", "down", "inter", "kw", "scaling")

    def __init__(self, layer, cfg, window_of):
        a, m = layer.self_attn, layer.mlp
        self.attn = a  # the transformers module: StepCache.attend reads its layer index and kernel settings
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv = _fused([a.q_proj, a.k_proj, a.v_proj])
        self.o = _Linear(a.o_proj.weight, a.o_proj.bias)
        self.gate_up = _fused([m.gate_proj, m.up_proj])
        self.down = _Linear(m.down_proj.weight, m.down_proj.bias)
        self.inter = m.gate_proj.out_features
        self.kw = {"sliding_window": window_of(a, cfg)}  # what the layer passes its attention kernel
        self.scaling = a.scaling


class LlamaNet:
    """The packed rows of one step through a Llama-family model: ``net(ids, position_ids, cache, keep)``."""

    name = "llama"

    def __init__(self, model):
        inner, cfg = model.model, model.config
        window_of = FAMILIES[type(model).__name__][4]
        a0 = inner.layers[0].self_attn
        self.hidden = cfg.hidden_size
        self.head_dim = a0.head_dim
        self.heads = a0.q_proj.out_features // self.head_dim
        self.kv_heads = a0.k_proj.out_features // self.head_dim
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.layers = [_Layer(layer, cfg, window_of) for layer in inner.layers]
        self.head = _Linear(model.get_output_embeddings().weight, None)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, cache, keep: list[int]) -> torch.Tensor:
        """Feed ``ids`` [rows] at ``position_ids`` [1, rows] (K/V through ``cache``); the fp32
        logits [len(keep), vocab] of rows ``keep``."""
        rows, h, kvh, d, hid = ids.shape[0], self.heads, self.kv_heads, self.head_dim, self.hidden
        parts = torch.get_num_threads() if ids.device.type == "cpu" else 1
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x[None], position_ids)
        cos, sin, half, qk_end = cos[0, :, None], sin[0, :, None], d // 2, (h + kvh) * d
        for layer in self.layers:
            qkv = layer.qkv(F.rms_norm(x, (hid,), layer.norm1, layer.eps1), parts)
            qk = qkv[:, :qk_end].view(rows, h + kvh, d)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # RoPE, q and k at once
            cache.update(qk[:, h:].transpose(0, 1)[None], qkv[:, qk_end:].view(rows, kvh, d).transpose(0, 1)[None],
                         layer.attn.layer_idx)
            o, _ = cache.attend(layer.attn, qk[:, :h].transpose(0, 1)[None], layer.scaling, layer.kw)
            x = x + layer.o(o.reshape(rows, h * d), parts)
            gu = layer.gate_up(F.rms_norm(x, (hid,), layer.norm2, layer.eps2), parts)
            x = x + layer.down(F.silu(gu[:, : layer.inter]) * gu[:, layer.inter :], parts)
        x = x[-1:] if keep == [rows - 1] else x[torch.tensor(keep, device=x.device)]
        return self.head(F.rms_norm(x, (hid,), self.norm, self.eps), parts).float()
