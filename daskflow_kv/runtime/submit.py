"""Submitting KV tasks with the annotations the scheduler plugin reads.

Three kinds of task leave this client:

* a *compute* task (``ComputeTask``: a prefill, a batched prefill, a parallel-prefill chunk;
  ``load_from_store`` for a store load) carries a ``kv`` annotation the plugin turns into a
  worker restriction, admission under the KV budget, a predicted queue and catalog events
  (``plugins/kv_scheduler.py``);
* a *block* task cuts one content-addressed block out of a compute task's output, on the
  worker that holds it; its annotation is the block's catalog entry;
* a *near* task reads a compute task's output where it is (results, branches, replicas).

Annotations travel with per-call keywords (``dask.annotate`` around one ``submit``), which
graph optimization cannot drop. They carry no session token: the plugin knows whose a task
is by the client stream it came on, and lets it run under its key only if the key carries
this namespace's tag (``key``, ``keys.task_key``). It reads the annotations and drops them
before any worker gets the task.

A compute task submitted inside a ``workflow_run`` names its run (``flow``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import dask
from distributed import Client, Future

from ..keys import PREFILL, STORE_LOAD, task_key
from ..policy.placement import Placement
from ..state.blocks import aligned_floor
from ..store import worker_io as store_io
from . import tasks
from .workflow_run import current_run


@dataclass(frozen=True, slots=True)
class ComputeTask:
    """One compute task: ``fn(spec, request, *inputs)`` on ``worker``."""

    fn: Callable  # what runs on the worker: tasks.prefill, tasks.prefill_batch, chunk_task.prefill_chunk
    request: object  # its request: a PrefillRequest, BatchPrefillRequest or ChunkRequest
    inputs: Sequence[Future]  # the prefix blocks it reads (Dask gathers them onto ``worker``)
    key: str  # its Dask key
    op: str  # the operator it serves: materialize, extend, merge, resume, recompute
    state_id: str  # the state (or batch) it computes
    worker: str | None  # where the plan runs it (strict; the plugin loosens it if the worker dies)
    reads: Sequence[str] = ()  # keys of the cached blocks among ``inputs`` (the plugin touches them)
    placement: Placement | None = None  # the plan's decision; only the first branch on a worker pays it
    predicted_s: float | None = None  # seconds the plan expects it to run (the plugin's queue estimate)
    kv_out: int | None = None  # KV bytes it adds to its worker (admission); None: from the request
    extra: Mapping[str, object] = field(default_factory=dict)  # more annotations: gang, gang_size, chunk, branches


@dataclass(slots=True, eq=False)
class Submitter:
    client: Client  # where tasks are submitted (the session's client: its tasks are the session's)
    spec: tasks.ModelSpec  # the model every compute task loads (its first argument); its namespace tags keys
    bytes_per_token: int  # K/V bytes one token takes in every layer
    vocab_size: int = 0  # logits per generated token, when a request asks for them (they share its output)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def namespace(self) -> str:
        return self.spec.namespace

    def key(self, kind: str, *ident) -> str:
        """A new task key of this namespace (``keys.task_key``): only its tasks may compute it."""
        return task_key(kind, self.namespace, *ident)

    # -- compute tasks ------------------------------------------------------------------------------
    def compute(self, task: ComputeTask) -> Future:
        p = task.placement
        note = self._note(task.op, task.state_id, task.worker, task.reads,
                          None if p is None else p.decision_dict(), bool(p is not None and p.first),
                          self.out_bytes(task.request) if task.kv_out is None else task.kv_out,
                          predicted_s=task.predicted_s, **task.extra)
        with dask.annotate(kv=note):
            return self.client.submit(task.fn, self.spec, task.request, *task.inputs, key=task.key,
                                      workers=[task.worker] if task.worker else None, pure=False)

    def prefill(self, req: tasks.PrefillRequest, inputs: Sequence[Future], worker: str | None,
                reads: Sequence[str] = (), placement: Placement | None = None,
                predicted_s: float | None = None) -> Future:
        """One ``prefill`` of ``req`` (its PrefillOutput stays on ``worker``)."""
        return self.compute(ComputeTask(tasks.prefill, req, inputs, self.key(PREFILL, req.op, req.state_id), req.op,
                                        req.state_id, worker, reads, placement, predicted_s))

    def prefill_batch(self, breq: tasks.BatchPrefillRequest, inputs: Sequence[Future], worker: str | None,
                      reads: Sequence[str] = (), placement: Placement | None = None,
                      predicted_s: float | None = None) -> Future:
        """One ``prefill_batch`` for several branches of one prefix on one worker."""
        return self.compute(ComputeTask(tasks.prefill_batch, breq, inputs, self.key(PREFILL, breq.op, breq.batch_id),
                                        breq.op, breq.batch_id, worker, reads, placement, predicted_s,
                                        extra={"branches": [r.state_id for r in breq.requests]}))

    def load_from_store(self, url: str, tenant, keys: list[str], state_id: str, worker: str | None, decision: dict,
                        nbytes: int) -> Future:
        """Read ``keys`` from the persistent store on ``worker`` as ``tenant`` (``store_io.load_blocks``)."""
        note = self._note("store-load", state_id, worker, (), decision, True, nbytes)
        with dask.annotate(kv=note):
            return self.client.submit(store_io.load_blocks, url, keys, tenant, key=self.key(STORE_LOAD, state_id),
                                      workers=[worker] if worker else None, pure=False)

    def out_bytes(self, req) -> int:
        """Bytes a prefill's output can hold at most: its blocks, from the aligned floor of what
        it reuses to the end of its prompt and generation, and its logits if asked for (fp32 at
        most). The plugin admits the task on them and, with tenants, refuses a larger result."""
        reqs = req.requests if isinstance(req, tasks.BatchPrefillRequest) else (req,)
        return sum((len(r.tokens) + r.max_new_tokens - aligned_floor(r.reused, self.block_size))
                   * self.bytes_per_token + (r.max_new_tokens * self.vocab_size * 4 if r.return_logits else 0)
                   for r in reqs)

    def _note(self, op: str, state_id: str, worker: str | None, reads: Sequence[str], decision: dict | None,
              first: bool, kv_out: int, **extra) -> dict:
        note = {"role": "compute", "op": op, "state_id": state_id, "target": worker,
                "reads": list(reads), "decision": decision, "first": first, "kv_out": kv_out, **extra}
        run = current_run()
        if run is not None:
            note["flow"] = run
        return note

    # -- tasks next to a compute task's output ------------------------------------------------------
    def block(self, key: str, meta: dict, worker: str | None, fn: Callable, *args) -> Future:
        """The task that makes block ``key`` (``meta``: its catalog entry) where its source is."""
        with dask.annotate(kv={"role": "block", "meta": meta}):
            return self.near(worker, fn, *args, key=key)

    def near(self, worker: str | None, fn: Callable, *args, key: str) -> Future:
        """Submit a task that reads a prefill's output where that output is.

        The restriction keeps Dask from treating these many small, few-input tasks as
        root-ish (queued on whichever worker is free) and work stealing from moving them,
        either of which would move the output instead. If the worker dies the plugin
        loosens it and they run wherever Dask recomputes their input.
        """
        return self.client.submit(fn, *args, key=key, workers=[worker] if worker else None, pure=False)
