"""The task each worker runs in a parallel materialize: prefill one chunk, hand K/V forward.

Chunk i of W runs ``ModelRunner.prefill_relayed`` on its planned worker: its own K/V of
each layer go to the later chunks' workers as soon as attention makes them, the earlier
chunks' K/V of each layer come from the channel (``handoff``). Its result is a
``PrefillOutput`` with the chunk's blocks, which the client cuts into content-addressed
keys on the same worker, exactly as after a single prefill.

A chunk prefills alone - every token from the cached prefix to its end, keeping only its
own blocks - when cooperating is impossible: its peer's worker died or gave up
(``PeerLost``), or Dask runs the task again (its worker died and it landed elsewhere, or a
lost block is recomputed from lineage long after the others finished). The blocks are the
same either way, so a worker's death costs time, never exactness.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..model.runner import RunOutput
from ..state.blocks import aligned_floor
from ..plugins.handoff import ALONE, DONE, FAILED, MAILBOX, Channel, Patience, PeerLost
from .tasks import ModelSpec, PrefillOutput, get_runner, prefill_output, report_prefill, worker_address

logger = logging.getLogger("daskflow_kv.handoff")


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    """Chunk ``index`` of a prefill of ``tokens`` split over ``workers``."""

    tokens: tuple[int, ...]  # the prompt, up to the end of the last chunk
    reused: int  # leading tokens whose K/V come from the prefix blocks passed to every chunk
    spans: tuple[tuple[int, int], ...]  # every chunk's [start, end); chunk 0 starts at ``reused``
    workers: tuple[str, ...]  # the worker planned for each chunk
    index: int  # this task's chunk
    group: str  # names this cooperation on the channel (unique per submission)
    patience: Patience  # how long to wait for a peer before prefilling alone
    op: str = "materialize"
    state_id: str = ""

    @property
    def span(self) -> tuple[int, int]:
        return self.spans[self.index]


def _alone(runner, req: ChunkRequest, prefix_blocks) -> RunOutput:
    """Every token from the cached prefix to the chunk's end; only the chunk's blocks kept."""
    start, end = req.span
    out = runner.run(list(prefix_blocks), req.reused, list(req.tokens[req.reused:end]), 0)
    first = aligned_floor(start, runner.block_size)
    out.new_blocks = [b for b in out.new_blocks if b[0] >= first]
    return out


def prefill_chunk(spec: ModelSpec, req: ChunkRequest, *prefix_blocks) -> PrefillOutput:
    runner = get_runner(spec)
    start, end = req.span
    address = worker_address()
    t0 = time.perf_counter()
    out, channel = None, None
    why = "run again" if address == req.workers[req.index] else f"moved off {req.workers[req.index]}"
    if address == req.workers[req.index] and MAILBOX.begin(req.group, req.index):
        from distributed import get_worker

        channel = Channel(get_worker(), req.group, req.index, req.workers, req.patience)
        last = req.index == len(req.spans) - 1
        try:
            out = runner.prefill_relayed(list(prefix_blocks), req.reused, start, list(req.tokens[start:end]),
                                         channel.recv if req.index else None, None if last else channel.send)
        except PeerLost as exc:
            MAILBOX.finish(req.group, req.index, ALONE)  # later chunks stop waiting for us at once
            why = str(exc)
        except BaseException:
            MAILBOX.finish(req.group, req.index, FAILED)
            raise
        else:
            MAILBOX.finish(req.group, req.index, DONE)
    relayed = out is not None
    if not relayed:
        logger.info("chunk %d of %s prefills alone: %s", req.index, req.group, why)
        out = _alone(runner, req, prefix_blocks)
    m = out.metrics
    report_prefill({
        "worker": address,
        "op": req.op,
        "state_id": req.state_id,
        "chunk": req.index,
        "chunks": len(req.spans),
        "span": [start, end],  # positions its blocks cover (alone, it computed from ``reused``)
        "relayed": relayed,
        "alone_because": None if relayed else why,
        # what this task computed, and the compute time of it (the profile's sample)
        "new_tokens": m.tokens_computed,
        "prefix_tokens": start if relayed else req.reused,
        "tokens_reused": req.reused if req.index == 0 else 0,  # the cached prefix counts once
        "seconds": m.prefill_s - m.relay_wait_s,
        "wait_seconds": m.relay_wait_s,
        "load_seconds": m.load_s,
        "task_seconds": time.perf_counter() - t0,
        "done_at": time.time(),  # wall clock: this chunk's blocks exist from here on
        "handoff_bytes_sent": channel.bytes_sent if channel else 0,
        "handoff_failures": channel.failures[:3] if channel else [],
        "handoff_layers_received": len(channel.transit) if channel else 0,
        "handoff_transit_s": sum(channel.transit) / len(channel.transit) if channel and channel.transit else 0.0,
    })
    return prefill_output(out, address)
