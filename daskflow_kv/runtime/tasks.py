"""Functions that run inside Dask tasks on workers.

A prefill task returns a ``PrefillOutput`` holding the new block tensors; one cheap
``take_block`` task per block then publishes each block under its content-addressed key,
on the same worker, sharing the tensor (no copy). Once every block has its own key the
client drops the ``PrefillOutput`` future and Dask frees it; the blocks stay, each kept
alive by the futures of the states that list it (and by the scheduler plugin's cache).

A block task may also carry a ``store_io.WriteRequest``: the block is then handed to the
worker's background store writer as it is published (write-through, never waited for).

The model is loaded once per worker process (``get_runner``), and every prefill reports
its timing to the scheduler plugin, which fits the prefill profile the cost model uses.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from dask.sizeof import sizeof

from .. import config
from ..dask_internals import running_task_key
from ..keys import PREFILL_TOPIC, tag_of
from ..model.runner import ModelRunner
from ..model.step_engine import StepRequest
from ..model.sampling import GREEDY, SamplingParams
from ..transport.serialization import register_torch_serialization, sizeof_torch_tensor
from ..store.worker_io import WriteRequest, persist
from . import step_worker, torch_threads

register_torch_serialization()  # workers unpickle this module before any block arrives

_LOAD_LOCK = threading.Lock()
_REPORTED: Counter[str] = Counter()  # prompt tokens this process's prefill events reported, by op
_REPORTED_LOCK = threading.Lock()  # not the load lock: a model load holds that for seconds


def reported_by_op() -> dict[str, int]:
    """Prompt tokens this worker's prefill tasks reported to the scheduler since start, by op
    (to set beside what its step loops fed: ``step_worker.prompt_tokens_by_op``)."""
    with _REPORTED_LOCK:
        return dict(_REPORTED)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything a worker needs to load the same model and agree on block keys."""

    model: str  # name, path or hub id (see model.zoo.loader)
    dtype: str = field(default_factory=lambda: config.get("dtype"))
    block_size: int = field(default_factory=lambda: config.get("block-size"))
    namespace: str = field(default_factory=lambda: config.get("namespace"))
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    fingerprint: object  # Fingerprint of the model as loaded on workers
    bytes_per_token: int  # KV bytes per token, all layers
    max_positions: int
    vocab_size: int
    eos_ids: frozenset[int]
    batch_unsupported: str | None = None  # why branches cannot share one prefill_batch (None: they can)
    num_layers: int = 1  # decoder layers (a parallel prefill hands K/V over once per layer)
    aligned_prefill: bool = False  # below fp32: prefills start on block boundaries (ModelRunner.reusable)


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """One prefill: continue ``tokens[:reused]`` (read from prefix blocks) with the rest."""

    tokens: tuple[int, ...]  # the whole prompt; the task prefills tokens[reused:]
    reused: int  # leading tokens whose K/V come from the prefix blocks passed along
    max_new_tokens: int = 0  # 0: prefill only (materialize, extend, replicas)
    sampling: SamplingParams = GREEDY
    stream: int = 0  # branch index, seeds sampling per branch
    return_logits: bool = False
    op: str = "prefill"  # lifecycle op it serves (materialize, resume, recompute, calibrate, ...)
    state_id: str = ""  # the state it produces, for events and lineage


@dataclass(slots=True)
class PrefillOutput:
    generated: list[int]  # sampled tokens (empty for a pure prefill)
    metrics: dict  # RunMetrics.as_dict()
    blocks: list[torch.Tensor]  # new blocks, from the aligned floor of the reused prefix
    spans: list[tuple[int, int]]  # token span of each new block
    worker: str  # address that ran it
    logits: torch.Tensor | None = None  # [generated, vocab] when asked for


@dataclass(frozen=True, slots=True)
class BatchPrefillRequest:
    """Several resumes of one prefix on one worker: one group in the worker's step loop.

    Every request continues the same ``reused`` leading tokens (read once from the prefix
    blocks passed along) and keeps its own stream, token limit and state id.
    """

    requests: tuple[PrefillRequest, ...]
    reused: int
    op: str = "resume"
    batch_id: str = ""  # names the batch in events


@dataclass(slots=True)
class BatchPrefillOutput:
    outputs: list[PrefillOutput]  # one per request, in order
    stats: dict  # BatchStats.as_dict()
    worker: str


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """The small, block-free part of a prefill: safe to gather to the client."""

    generated: list[int]
    metrics: dict = field(hash=False)
    worker: str = ""
    logits: torch.Tensor | None = field(default=None, hash=False)


# The scheduler plans memory and transfers from these sizes: report the tensors, not the
# few hundred bytes of the Python objects around them.
@sizeof.register(PrefillOutput)
def _sizeof_prefill_output(out: PrefillOutput) -> int:
    tensors = sum(sizeof_torch_tensor(b) for b in out.blocks)
    return tensors + (0 if out.logits is None else sizeof_torch_tensor(out.logits)) + 64 + 8 * len(out.generated)


@sizeof.register(BatchPrefillOutput)
def _sizeof_batch_prefill_output(out: BatchPrefillOutput) -> int:
    return sum(_sizeof_prefill_output(o) for o in out.outputs) + 256


@sizeof.register(GenerationResult)
def _sizeof_generation_result(res: GenerationResult) -> int:
    return (0 if res.logits is None else sizeof_torch_tensor(res.logits)) + 64 + 8 * len(res.generated)


def _default_device(spec: ModelSpec) -> str:
    if spec.device != "auto":
        return spec.device
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=4)
def _runner(spec: ModelSpec) -> ModelRunner:
    from ..model.emulated_profile import is_emulated
    from ..model.zoo.loader import load_model

    if is_emulated(spec.model):  # a profile, no weights (its K/V dtype is the profile's, not spec.dtype)
        from ..model.emulated_runner import emulated_runner

        return emulated_runner(spec.model, spec.block_size, spec.namespace)

    lm = load_model(spec.model, dtype=spec.dtype, device=_default_device(spec))
    return ModelRunner(lm.model, lm.tokenizer, lm.model_id, spec.block_size, spec.namespace)


def get_runner(spec: ModelSpec) -> ModelRunner:
    with _LOAD_LOCK:  # one load per process even when several worker threads ask at once
        if not _runner.cache_info().currsize:  # the first model here: torch gets the worker's cores
            torch_threads.apply()
        return _runner(spec)


def worker_address() -> str:
    """The address of the worker running this task (``local-<pid>`` outside one)."""
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return f"local-{os.getpid()}"


def report_prefill(event: dict) -> None:
    """A prefill's timing, for the scheduler plugin's fitted profiles (the prefill topic), with
    the namespace tag of the task that ran it (whose counters it adds to; no key, no tokens)."""
    with _REPORTED_LOCK:
        _REPORTED[event.get("op", "")] += int(event.get("new_tokens") or 0)
    try:
        from distributed import get_worker

        get_worker().log_event(PREFILL_TOPIC, {**event, "tag": tag_of(running_task_key())})
    except ValueError:
        pass  # not inside a worker (direct call in tests): nothing to report to


def model_facts(spec: ModelSpec) -> ModelFacts:
    from ..model.batched_cache import unsupported_layers

    r = get_runner(spec)
    if r.model is None:  # emulated: every request may share a step, at any token
        return ModelFacts(r.fingerprint, r.bytes_per_token, r.max_positions, r.vocab_size, frozenset(r.eos_ids),
                          None, r.num_layers, False)
    cfg = r.model.config.get_text_config() if hasattr(r.model.config, "get_text_config") else r.model.config
    # Below fp32 a k-row batched decode rounds unlike one branch's decode, and bf16 greedy
    # tokens then drift from text mode's (SmolLM2): such models resume branch by branch.
    batch = unsupported_layers(cfg) or (f"{str(r.dtype).removeprefix('torch.')} batched decode rounds unlike a "
                                        "single branch's" if r.aligned_prefill else None)
    return ModelFacts(r.fingerprint, r.bytes_per_token, r.max_positions, r.vocab_size, frozenset(r.eos_ids),
                      batch, r.num_layers, r.aligned_prefill)


def prefill(spec: ModelSpec, req: PrefillRequest, *prefix_blocks: torch.Tensor) -> PrefillOutput:
    """Prefill ``req.tokens[req.reused:]`` on top of ``prefix_blocks`` (>= reused tokens)."""
    runner = get_runner(spec)
    t0 = time.perf_counter()
    [out] = step_worker.run(runner, [_step_request(req, list(prefix_blocks), req.reused)])
    worker = worker_address()
    report_prefill(
        {
            "worker": worker,
            "op": req.op,
            "state_id": req.state_id,
            "new_tokens": len(req.tokens) - req.reused,
            "prefix_tokens": req.reused,
            "seconds": out.metrics.prefill_s,
            "load_seconds": out.metrics.load_s,
            "task_seconds": time.perf_counter() - t0,
            "done_at": time.time(),  # wall clock: its K/V (the prefix it made) exist from here on
            "shared_steps": out.metrics.shared_steps,  # > 0: batched with others, not a clean timing
        }
    )
    return prefill_output(out, worker)


def warm_up(spec: ModelSpec, tokens: tuple[int, ...]) -> int:
    """One prefill that reports no timing and keeps nothing: a worker's first forward pays
    one-time costs (kernels chosen, buffers grown; measured: a first 64-token probe 0.26 s,
    the next ones 0.19-0.21 s), which a calibration must not fit as every prefill's fixed
    cost. -> tokens prefilled."""
    runner = get_runner(spec)
    step_worker.run(runner, [_step_request(PrefillRequest(tokens, 0, op="warm-up"), [], 0)])
    return len(tokens)


def prefill_output(out, worker: str) -> PrefillOutput:
    """A runner's RunOutput as a task result: blocks and their spans, tensors not copied."""
    return PrefillOutput(
        out.generated,
        out.metrics.as_dict(),
        [b for _, _, b in out.new_blocks],
        [(s, e) for s, e, _ in out.new_blocks],
        worker,
        out.logits,
    )


def prefill_batch(spec: ModelSpec, breq: BatchPrefillRequest, *prefix_blocks: torch.Tensor) -> BatchPrefillOutput:
    """Every request of ``breq`` as one group of the step loop: the prefix held once (``step_cache``).

    Branch j samples from stream ``requests[j].stream``, as ``prefill`` would, so its tokens
    are those of a single resume. One timing event covers the whole batch.
    """
    runner = get_runner(spec)
    reqs = breq.requests
    if len({(r.sampling or GREEDY, r.return_logits) for r in reqs}) != 1:
        raise ValueError("a prefill batch needs one sampling setting and one return_logits for all branches")
    if any(r.reused != breq.reused for r in reqs):
        raise ValueError("every branch of a prefill batch continues the same reused prefix")
    t0 = time.perf_counter()
    outs = step_worker.run(runner, [_step_request(r, list(prefix_blocks), breq.reused) for r in reqs],
                           shared_prefix=True)
    stats = _batch_stats(outs)
    worker = worker_address()
    report_prefill(
        {
            "worker": worker,
            "op": breq.op,
            "state_id": breq.batch_id,
            "state_ids": [r.state_id for r in reqs],
            "branches": len(reqs),
            "new_tokens": sum(len(r.tokens) - breq.reused for r in reqs),
            "prefix_tokens": breq.reused,  # what each new token attended to (the profile's input)
            "tokens_reused": breq.reused * len(reqs),  # every branch reused the prefix (the counter's)
            "seconds": stats["prefill_s"],
            "load_seconds": stats["load_s"],
            "shared_steps": max(o.metrics.shared_steps for o in outs),  # steps shared beyond the batch
            "task_seconds": time.perf_counter() - t0,
            "done_at": time.time(),
        }
    )
    outputs = [prefill_output(out, worker) for out in outs]
    return BatchPrefillOutput(outputs, stats, worker)


def _step_request(req: PrefillRequest, prefix_blocks: list, reused: int) -> StepRequest:
    return StepRequest(prefix_blocks, reused, list(req.tokens[reused:]), req.max_new_tokens, req.sampling or GREEDY,
                       req.stream, req.return_logits, op=req.op)


def _batch_stats(outs) -> dict:
    """A batch's timings as one event reports them: its slowest branch's (they ran together)."""
    keys = ("load_s", "prefill_s", "decode_s", "export_s")
    return {k: max(getattr(o.metrics, k) for o in outs) for k in keys} | {"branches": len(outs)}


def take_branch(output: BatchPrefillOutput, index: int) -> PrefillOutput:
    return output.outputs[index]


def take_block(output: PrefillOutput, index: int, store: WriteRequest | None = None) -> torch.Tensor:
    """Block ``index`` of a prefill's (or a store load's) output; queued for the store if asked."""
    return persist(output.blocks[index], store)


def take_result(output: PrefillOutput) -> GenerationResult:
    return GenerationResult(list(output.generated), dict(output.metrics), output.worker, output.logits)


def take_batch_results(output: BatchPrefillOutput) -> list[GenerationResult]:
    """Every branch's small result of a batch, in one task (its tensors stay on the worker)."""
    return [take_result(o) for o in output.outputs]


def cut_block(block: torch.Tensor, tokens: int, store: WriteRequest | None = None) -> torch.Tensor:
    """The first ``tokens`` tokens of a block (a cached prefix that ends mid-block)."""
    return persist(block[:, :, :, :tokens].contiguous(), store)


def text_generate(
    spec: ModelSpec, tokens: list[int], max_new_tokens: int, sampling: SamplingParams, stream: int, return_logits: bool
) -> GenerationResult:
    """Text mode on a worker: the whole prompt prefilled from nothing, nothing kept."""
    req = StepRequest([], 0, list(tokens), max_new_tokens, sampling or GREEDY, stream, return_logits, export=False,
                      op="text")
    [out] = step_worker.run(get_runner(spec), [req])
    return GenerationResult(out.generated, out.metrics.as_dict(), worker_address(), out.logits)


def probe_bytes(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A calibration payload: measures worker-to-worker bandwidth with real frames.

    Made on the device the KV blocks live on (``ModelSpec.device``; "auto" resolved here),
    so a GPU cluster measures device-to-device moves, not host copies.
    """
    dev = _default_device(ModelSpec("", "float32", 1, "", device))
    return torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)


def touch(*tensors: torch.Tensor) -> int:
    """Depends on its inputs (so Dask moves them here) and returns their byte count."""
    return sum(t.numel() * t.element_size() for t in tensors)
