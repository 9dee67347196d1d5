"""Forward passes over KV blocks: load a prefix, prefill new tokens, decode, export blocks.

The runner knows tensors and the model, nothing about stores, states or Dask. The
single-process engine and the Dask tasks both call ``run``: text mode is ``run`` with an
empty prefix, so baseline and reuse share one code path and differ only in what is cached.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
import transformers

from .. import config
from ..state.blocks import aligned_floor, reusable_prefix, split_spans
from .cache_layer import growable_cache
from . import relay_cache
from .relay_attention import relay_twin
from ..state.fingerprint import Fingerprint, fingerprint_model
from .sampling import GREEDY, SamplingParams, choose


@dataclass(slots=True)
class RunMetrics:
    tokens_reused: int = 0  # prefix tokens whose K/V came from blocks
    tokens_computed: int = 0  # tokens prefilled by this run (decode steps excluded)
    tokens_generated: int = 0  # new tokens sampled
    load_s: float = 0.0  # copying prefix blocks into the working cache
    prefill_s: float = 0.0  # forward over the new tokens (to the first generated token)
    decode_s: float = 0.0  # the remaining decode steps
    export_s: float = 0.0  # cutting the new blocks out of the cache
    first_token_at: float = 0.0  # wall clock (time.time()) when the first token was sampled: TTFT's end
    relay_wait_s: float = 0.0  # inside prefill_s: waiting for other workers' K/V (parallel prefill)
    shared_steps: int = 0  # step loop: steps of its prefill that also fed other requests (0: it ran alone)

    @property
    def ttft_s(self) -> float:
        return self.load_s + self.prefill_s

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["ttft_s"] = self.ttft_s
        return d


@dataclass(slots=True)
class RunOutput:
    generated: list[int]  # sampled tokens, EOS included if hit
    fed_tokens: int  # tokens now in the cache: prefix + new + generated[:-1]
    new_blocks: list[tuple[int, int, torch.Tensor]]  # (start, end, block) from the aligned floor
    logits: torch.Tensor | None  # [generated, vocab] fp32 logits that chose each token
    metrics: RunMetrics = field(default_factory=RunMetrics)


class ModelRunner:
    """One loaded model plus what a KV state must agree with to be used by it."""

    def __init__(self, model, tokenizer, model_id: str, block_size: int | None = None, namespace: str | None = None):
        if "cache" not in inspect.signature(model.forward).parameters:
            # Older transformers take past_key_values and would silently drop `cache=`: the
            # resumed prefix would be ignored and outputs wrong. Refuse instead.
            raise RuntimeError(
                f"{type(model).__name__}.forward has no `cache` argument (transformers "
                f"{transformers.__version__}); daskflow-kv needs transformers >= 5.24"
            )
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = config.get("block-size", block_size)
        self.fingerprint: Fingerprint = fingerprint_model(model, tokenizer, model_id, config.get("namespace", namespace))
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # Below fp32 a row's rounding depends on how many rows a matmul is fed: prefill is then
        # fed in block-sized chunks at absolute block boundaries, the same in both modes (see run).
        self.aligned_prefill = self.dtype != torch.float32
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    def reusable(self, reused: int) -> int:
        """How much of a cached prefix a prefill may start from: all of it in fp32; below fp32
        only whole blocks, so the suffix is fed in the chunks text mode feeds it in."""
        return reusable_prefix(reused, self.block_size, self.aligned_prefill)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    # -- cache <-> blocks ---------------------------------------------------------------
    def _load(self, cache, blocks: list[torch.Tensor]) -> None:
        # Each block is [layers, 2, kv_heads, tokens, head_dim]; the cache wants
        # [1, kv_heads, tokens, head_dim] per layer. One copy per block per layer.
        for block in blocks:
            block = block.to(self.device, non_blocking=True)
            for i, layer in enumerate(cache.layers):
                layer.update(block[i, 0].unsqueeze(0), block[i, 1].unsqueeze(0))

    def _export(self, cache, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
        out = []
        for s, e in split_spans(start, end, self.block_size):
            block = torch.stack(
                [torch.stack((layer.keys[0, :, s:e], layer.values[0, :, s:e])) for layer in cache.layers]
            )
            out.append((s, e, block.contiguous()))
        return out

    def _start(self, cache, prefix_blocks: list[torch.Tensor], prefix_len: int) -> None:
        """Load the prefix blocks into ``cache`` and cut a partly reused last block."""
        if sum(b.shape[3] for b in prefix_blocks) < prefix_len:
            raise ValueError(f"prefix blocks hold fewer than the {prefix_len} tokens asked for")
        self._load(cache, prefix_blocks)
        extra = cache.get_seq_length() - prefix_len
        if extra > 0:  # the last block is reused only in part: drop its other tokens
            for layer in cache.layers:
                layer.crop(-extra)

    def open_cache(self, prefix_blocks: list[torch.Tensor], prefix_len: int, capacity: int):
        """A cache holding the first ``prefix_len`` tokens of ``prefix_blocks``, with room for
        ``capacity`` tokens in all: what ``run`` feeds, one forward at a time (``feed``)."""
        cache = growable_cache(self.num_layers, capacity=capacity)
        self._start(cache, prefix_blocks, prefix_len)
        return cache

    def feed(self, cache, tokens: list[int]) -> torch.Tensor:
        """One forward of ``tokens`` after what ``cache`` holds; the last token's fp32 logits."""
        return self._forward(cache, tokens)

    def prefill_chunks(self, start: int, n: int) -> list[int]:
        """The chunk sizes ``run`` feeds a prompt of ``n`` tokens at position ``start`` in:
        one chunk in fp32, chunks ending on absolute block boundaries below it."""
        if not self.aligned_prefill:
            return [n]
        out, pos = [], start
        while pos < start + n:
            stop = min(start + n, (pos // self.block_size + 1) * self.block_size)
            out.append(stop - pos)
            pos = stop
        return out

    def export_blocks(self, cache, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
        """Blocks of positions [start, end) cut from ``cache``, in ``run``'s format."""
        return self._export(cache, start, end)

    # -- forward --------------------------------------------------------------------------
    def _prefill(self, cache, start: int, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` at positions ``start``...; the last one's logits.

        Below fp32, in chunks ending on absolute block boundaries: text mode (from 0) and a
        resume (from a block boundary) then run every chunk with the same rows and shapes,
        so their K/V and logits are bit-identical whatever the CPU's kernels do with row
        counts (measured: SmolLM2 bf16 logits 1.7 apart without it, 0 with it).
        """
        logits, pos = None, 0
        for n in self.prefill_chunks(start, len(tokens)):
            logits = self._forward(cache, tokens[pos : pos + n])
            pos += n
        return logits

    def _forward(self, cache, tokens: list[int], model=None) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = (model or self.model)(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def run(
        self,
        prefix_blocks: list[torch.Tensor],
        prefix_len: int,
        new_tokens: list[int],
        max_new_tokens: int = 0,
        sampling: SamplingParams = GREEDY,
        stream: int = 0,
        return_logits: bool = False,
        export: bool = True,
    ) -> RunOutput:
        """Continue a prefix of ``prefix_len`` tokens with ``new_tokens``, then decode.

        Returns the generated tokens and the blocks from ``aligned_floor(prefix_len)`` to the
        end of the cache, so a prefix's partial last block is rewritten whole by its child.
        """
        if not new_tokens:
            raise ValueError("run needs at least one new token to feed")
        if self.reusable(prefix_len) != prefix_len:
            raise ValueError(f"a {self.dtype} prefill starts on a block boundary (prefix {prefix_len}, block "
                             f"{self.block_size}): pass reusable(prefix) tokens of prefix and feed the rest")
        m = RunMetrics(tokens_reused=prefix_len, tokens_computed=len(new_tokens))
        cache = growable_cache(self.num_layers, capacity=prefix_len + len(new_tokens) + max_new_tokens)

        t0 = time.perf_counter()
        self._start(cache, prefix_blocks, prefix_len)
        t1 = time.perf_counter()
        logits = self._prefill(cache, prefix_len, list(new_tokens))
        gen_stream = sampling.generator(stream)
        generated: list[int] = []
        kept: list[torch.Tensor] = []
        if max_new_tokens:
            generated.append(choose(logits, sampling, gen_stream))
            kept.append(logits)
        t2 = time.perf_counter()
        m.first_token_at = time.time()
        while generated and len(generated) < max_new_tokens and generated[-1] not in self.eos_ids:
            logits = self._forward(cache, [generated[-1]])
            generated.append(choose(logits, sampling, gen_stream))
            kept.append(logits)
        t3 = time.perf_counter()
        fed = cache.get_seq_length()
        blocks = self._export(cache, aligned_floor(prefix_len, self.block_size), fed) if export else []
        t4 = time.perf_counter()

        m.tokens_generated = len(generated)
        m.load_s, m.prefill_s, m.decode_s, m.export_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        stacked = torch.stack(kept) if (return_logits and kept) else None
        return RunOutput(generated, fed, blocks, stacked, m)

    @torch.inference_mode()
    def prefill_relayed(
        self,
        prefix_blocks: list[torch.Tensor],
        prefix_len: int,
        start: int,
        new_tokens: list[int],
        recv: relay_cache.Recv | None,
        send: relay_cache.Send | None,
    ) -> RunOutput:
        """One chunk of a parallel prefill: positions [start, start + len(new_tokens)).

        Positions [0, prefix_len) come from ``prefix_blocks``; [prefix_len, start) are other
        chunks, prefilled elsewhere at the same time, whose K/V arrive per layer through
        ``recv``; this chunk's own K/V leave through ``send`` as they are made. Returns the
        blocks from ``aligned_floor(start)`` to the chunk's end, as ``run`` would.
        """
        if not new_tokens:
            raise ValueError("a chunk needs at least one token")
        if start < prefix_len:
            raise ValueError(f"chunk start {start} lies inside the {prefix_len}-token prefix")
        m = RunMetrics(tokens_reused=prefix_len, tokens_computed=len(new_tokens))
        cache = relay_cache.relay_cache(self.num_layers, capacity=start + len(new_tokens))
        t0 = time.perf_counter()
        self._start(cache, prefix_blocks, prefix_len)
        relay_cache.arm(cache, start - prefix_len, recv, send)
        t1 = time.perf_counter()
        self._forward(cache, list(new_tokens), relay_twin(self.model))
        t2 = time.perf_counter()
        blocks = self._export(cache, aligned_floor(start, self.block_size), start + len(new_tokens))
        m.load_s, m.prefill_s, m.export_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        m.relay_wait_s = relay_cache.waited_seconds(cache)
        return RunOutput([], start + len(new_tokens), blocks, None, m)
