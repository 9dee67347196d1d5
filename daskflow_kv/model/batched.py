"""Batched resume: k forks of one state decode together over one copy of their prefix.

``ModelRunner.run`` resumes one branch at a time and loads its own copy of the prefix per
branch. ``resume_batch`` loads the prefix once into a ``SharedPrefixCache``, prefills all
branches' suffixes in one left-padded forward, then decodes every live branch in one
forward per step (one pass over the weights for all of them). Ragged suffixes, per-branch
EOS and per-branch token limits are handled by keeping a list of live branches: a branch
that finishes simply stops being fed. Each branch samples from its own generator
(``sampling.generator(stream)``), so it draws exactly what a single resume with that
stream draws.

The forward runs on a *twin* of the model: a shallow copy that shares every parameter and
buffer but whose config names the ``daskflow_batched`` attention kernel, so the shared
model (which other threads may be using) is never reconfigured.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..state.blocks import aligned_floor, split_spans
from .batched_cache import CTX_KW, SharedPrefixCache, register_batched_attention, unsupported_layers
from .runner import ModelRunner, RunMetrics, RunOutput
from .sampling import GREEDY, SamplingParams, choose

_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_TWIN_LOCK = threading.Lock()
_READY_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)  # a 4-D mask: transformers builds none


def batched_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the batched attention kernel; shares all tensors (no weight copy)."""
    with _TWIN_LOCK:
        twin = _TWINS.get(model)
        if twin is None:
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            reason = unsupported_layers(cfg)
            if reason:
                raise NotImplementedError(f"batched resume does not support {reason}")
            memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
            twin = copy.deepcopy(model, memo)
            twin.config._attn_implementation = register_batched_attention()
            head = twin.get_output_embeddings()
            if type(head) is torch.nn.Linear:  # the twin's own copy of the module (the weight is shared)
                head.__class__ = _ManyRowsHead
            _TWINS[model] = twin
        return twin


class _ManyRowsHead(torch.nn.Linear):
    """The vocabulary head for the several rows of a batched step, on a CPU.

    MKL's product of a few rows with a tall [vocab, hidden] weight took 1.5-2.5x the time of
    the same product written weight-first (W @ x^T) for 8-12 rows here (SmolLM2: 19-32 ms
    against 12-13 ms; equal at 4-6 rows, slower below 4; ``benchmarks/continuous_batching.py``
    shows the step time). The rows' logits are the same dot products, rounded in another order
    (fp32: ~1e-6 relative, within the batched tolerance)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < 4 or x.device.type != "cpu":
            return super().forward(x)
        out = torch.matmul(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass(slots=True)
class BatchStats:
    branches: int  # k
    mode: str  # replay | shared attention
    prefix_tokens: int  # P, held once
    tail_tokens: list[int]  # tokens each branch fed beyond the prefix (suffix + generated - 1)
    reserved_tail_tokens: list[int]  # pool capacity per branch (= tail_tokens unless EOS came early)
    kv_bytes: int  # K/V bytes the batch cache allocated: prefix + tail pool (+ replay workspace tail)
    ideal_kv_bytes: int  # bytes_per_token * (P + sum(tail_tokens)): one prefix plus the tails
    unshared_kv_bytes: int  # bytes_per_token * sum(P + tail): k private caches, as k concurrent resumes
    scratch_bytes: int  # fp32 attention workspace for one layer (bf16 replay), reused by all layers
    forwards: int  # model forwards run (prefill + decode steps)
    load_s: float = 0.0  # prefix blocks -> cache, once
    prefill_s: float = 0.0  # the batched suffix prefill
    decode_s: float = 0.0  # all decode steps
    export_s: float = 0.0  # cutting every branch's new blocks

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.ideal_kv_bytes

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["kv_ratio"] = self.kv_ratio
        return d


@dataclass(slots=True)
class BatchOutput:
    outputs: list[RunOutput]  # one per branch, in input order; same format as ModelRunner.run
    stats: BatchStats = field(default=None)

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, i) -> RunOutput:
        return self.outputs[i]


def _forward(twin, cache: SharedPrefixCache, active: list[int], rows: list[list[int]], device) -> torch.Tensor:
    """One forward of ``rows`` (left-padded) for the ``active`` branches; [a, vocab] fp32 logits."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for j, (b, r) in enumerate(zip(active, rows)):
        ids[j, width - len(r) :] = torch.tensor(r)
        start = cache.prefix_len + cache.lens[b] - (width - len(r))
        pos[j] = torch.arange(start, start + width).clamp_(min=0)
    ids, pos = ids.to(device), pos.to(device)
    cache.begin_step(active, [len(r) for r in rows], width, pos)
    out = twin(
        input_ids=ids,
        position_ids=pos,
        attention_mask=_READY_MASK.to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
        **{CTX_KW: cache},
    )
    cache.end_step()
    return out.logits[:, -1].float()


@torch.inference_mode()
def resume_batch(
    runner: ModelRunner,
    prefix_blocks: list[torch.Tensor],
    prefix_len: int,
    suffixes: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams = GREEDY,
    streams: Sequence[int] | None = None,
    return_logits: bool = False,
    export: bool = True,
    attention: str = "replay",
    prefill: str = "batched",
) -> BatchOutput:
    """Resume k branches of one prefix together; branch i equals ``runner.run(..., stream=streams[i])``.

    ``suffixes[i]`` (non-empty) is fed after the first ``prefix_len`` tokens of
    ``prefix_blocks``; branch i then decodes up to ``max_new_tokens[i]`` tokens or to EOS.
    ``attention``: "replay" (attention bit-identical to a single resume) or "shared" (prefix
    read once per step, log-sum-exp merge; see batched_cache). ``prefill``: "batched" (one forward for all suffixes) or
    "per_branch" (one forward per suffix: the same matmul shapes as a single resume).
    """
    k = len(suffixes)
    suffixes = [list(s) for s in suffixes]
    if k == 0:
        raise ValueError("resume_batch needs at least one branch")
    if any(not s for s in suffixes):
        raise ValueError("every branch needs at least one new token to feed")
    limits = [int(max_new_tokens)] * k if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    streams = list(range(k)) if streams is None else list(streams)
    if len(limits) != k or len(streams) != k:
        raise ValueError(f"{k} suffixes but {len(limits)} token limits and {len(streams)} streams")
    if min(limits) < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if prefill not in ("batched", "per_branch"):
        raise ValueError(f"prefill={prefill!r}; expected 'batched' or 'per_branch'")
    twin = batched_twin(runner.model)
    caps = [len(s) + max(m, 1) - 1 for s, m in zip(suffixes, limits)]
    cache = SharedPrefixCache(
        runner.model.config.get_text_config()
        if hasattr(runner.model.config, "get_text_config")
        else runner.model.config,
        prefix_len,
        caps,
        runner.kv_heads,
        runner.head_dim,
        runner.dtype,
        runner.device,
        mode=attention,
    )
    gens = [sampling.generator(s) for s in streams]
    generated: list[list[int]] = [[] for _ in range(k)]
    kept: list[list[torch.Tensor]] = [[] for _ in range(k)]
    forwards = 0

    def take(active, logits):
        greedy = logits.argmax(-1).tolist() if sampling.greedy else None  # one device sync for all rows
        for j, b in enumerate(active):
            if len(generated[b]) < limits[b]:
                generated[b].append(greedy[j] if greedy is not None else choose(logits[j], sampling, gens[b]))
                if return_logits:
                    kept[b].append(logits[j].clone())

    def live(b):
        g = generated[b]
        return bool(g) and len(g) < limits[b] and g[-1] not in runner.eos_ids

    t0 = time.perf_counter()
    cache.load_prefix(prefix_blocks)
    t1 = time.perf_counter()
    groups = [list(range(k))] if prefill == "batched" else [[b] for b in range(k)]
    for group in groups:
        take(group, _forward(twin, cache, group, [suffixes[b] for b in group], runner.device))
        forwards += 1
    t2 = time.perf_counter()
    first_at = time.time()  # every branch's first token comes out of the batched suffix prefill
    finished_at = [t2] * k
    active = [b for b in range(k) if live(b)]
    while active:
        take(active, _forward(twin, cache, active, [[generated[b][-1]] for b in active], runner.device))
        forwards += 1
        now = time.perf_counter()
        for b in active:
            finished_at[b] = now
        active = [b for b in active if live(b)]
    t3 = time.perf_counter()

    outputs = []
    for b in range(k):
        te = time.perf_counter()
        fed = prefix_len + cache.lens[b]
        blocks = (
            _export(cache, b, aligned_floor(prefix_len, runner.block_size), fed, runner.block_size) if export else []
        )
        m = RunMetrics(tokens_reused=prefix_len, tokens_computed=len(suffixes[b]), tokens_generated=len(generated[b]))
        m.load_s, m.prefill_s, m.decode_s = t1 - t0, t2 - t1, finished_at[b] - t2
        m.first_token_at = first_at
        m.export_s = time.perf_counter() - te
        logits = torch.stack(kept[b]) if (return_logits and kept[b]) else None
        outputs.append(RunOutput(generated[b], fed, blocks, logits, m))
    t4 = time.perf_counter()

    bpt = runner.bytes_per_token
    tails = list(cache.lens)
    stats = BatchStats(
        branches=k,
        mode=attention,
        prefix_tokens=prefix_len,
        tail_tokens=tails,
        reserved_tail_tokens=caps,
        kv_bytes=cache.kv_bytes,
        ideal_kv_bytes=bpt * (prefix_len + sum(tails)),
        unshared_kv_bytes=bpt * sum(prefix_len + t for t in tails),
        scratch_bytes=cache.scratch_bytes,
        forwards=forwards,
        load_s=t1 - t0,
        prefill_s=t2 - t1,
        decode_s=t3 - t2,
        export_s=t4 - t3,
    )
    return BatchOutput(outputs, stats)


def _export(cache: SharedPrefixCache, b: int, start: int, end: int, block_size: int):
    """Branch b's blocks over [start, end), in ModelRunner's format: (start, end, [L, 2, kvh, t, d])."""
    out = []
    for s, e in split_spans(start, end, block_size):
        layers = [torch.stack(cache.branch_kv(layer, b, s, e)) for layer in range(len(cache.pool))]
        out.append((s, e, torch.stack(layers).contiguous()))
    return out
