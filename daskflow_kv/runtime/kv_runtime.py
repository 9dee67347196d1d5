"""KV states as Dask futures: materialize, fork, resume, extend, merge across workers.

``KVRuntime`` is the distributed counterpart of ``Engine``. Blocks are Dask keys (their
content addresses) held in worker memory; a ``DistKVState`` is a descriptor plus the
futures that keep its blocks alive. Every prefill first asks the scheduler plugin for the
longest cached prefix (any client's); the plugin hands this client a reference to the
matched blocks before it answers, so they cannot be evicted in between. The planner then
decides per destination worker whether the consumer reuses local blocks, fetches them (Dask
moves each block once per worker) or recomputes the prefix there, using the cost model fed
with measured bandwidth and prefill profiles. Decisions travel as task annotations; the
plugin turns them into loose worker restrictions and catalog events.

Keys never get a second run spec: a block key the scheduler already knows (cached, being
computed, or released but still in lineage) is acquired, not resubmitted.

With a persistent store (``kv_store=``, see ``kv_persistence``) a prefix found in no
worker's memory may be loaded from the store instead of prefilled, and new shared blocks
are written through in the background.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import dask
from distributed import Client, Future, wait

from .. import config, validation
from ..keys import PREFILL, REPLICA, RESULT, task_key
from ..dask_internals import hold_futures
from .session import login
from ..model.text_codec import TextCodec
from ..state import compat
from ..state.blocks import (
    BlockRef,
    aligned_floor,
    block_key,
    chain_keys,
    common_prefix_len,
    keyed_digest,
    reusable_prefix,
    split_spans,
)
from ..policy.cost_model import Decision, NeedsCalibration, explain
from ..errors import MergeError, StateReleasedError
from ..state.kv_state import KVState, LineageEvent, new_state_id
from ..model.sampling import GREEDY, SamplingParams
from . import parallel_materialize, tasks
from ..policy.placement import POLICIES, ClusterView, Placement, batch_seconds, plan_placements, read_blocks
from .handles import DistGeneration, DistKVState, _Match
from .kv_persistence import PersistentTier
from ..transport import serialization  # noqa: F401  -- this client reads tensors (logits) too


class KVRuntime(PersistentTier, TextCodec):
    def __init__(
        self,
        client: Client,
        model: str | None = None,
        dtype: str | None = None,
        block_size: int | None = None,
        namespace: str | None = None,
        device: str = "cpu",
        kv_budget_bytes: int | str | None = None,
        memory_weight: float | None = None,
        secret: str | None = None,
        kv_store: str | None = None,
        kv_store_write: str | None = None,
    ):
        """``namespace``/``secret``: the tenant this runtime acts for (default: dask.config's
        ``daskflow-kv.namespace`` / ``daskflow-kv.secret``). Blocks are found, shared and
        listed only inside the namespace, under keys nobody without its secret can compute.

        ``kv_store``: a persistent KV tier, a directory or fsspec URL (``file:///data/kv``,
        ``s3://bucket/kv``; default ``daskflow-kv.store.url``) that client and workers reach;
        ``kv_store_write``: all | materialize-only | off (default ``daskflow-kv.store.write``)."""
        from ..model.zoo.loader import load_tokenizer
        from ..model.zoo.names import check_model
        from ..plugins.kv_scheduler import KVSchedulerPlugin

        validation.instance("client", client, Client)
        model = check_model(config.get("model", model), "model")
        dtype = validation.setting("dtype", dtype, "dtype", validation.dtype)
        block_size = validation.setting("block-size", block_size, "block_size", validation.block_size)
        kv_budget_bytes = validation.optional("kv_budget_bytes", kv_budget_bytes, validation.byte_size, minimum=0)
        memory_weight = validation.optional("memory_weight", memory_weight, validation.number, minimum=0)
        validation.setting("kv-budget", None, "kv_budget_bytes", validation.optional, validation.byte_size, minimum=0)
        self._init_store(kv_store, kv_store_write)
        self.client = client
        self.spec = tasks.ModelSpec(model, dtype, block_size, config.get("namespace", namespace), device)
        # Idempotent: a plugin already there (preload, another runtime) stays, with its catalog.
        # It installs the worker plugins and the KV page itself (plugins/kv_scheduler.py).
        client.register_plugin(KVSchedulerPlugin())
        self.session = login(client, self.spec.namespace, secret)
        if kv_budget_bytes is not None or memory_weight is not None:  # explicit arguments win over config
            self.configure(kv_budget_bytes=config.get_bytes("kv-budget", kv_budget_bytes), memory_weight=memory_weight)
        self.facts: tasks.ModelFacts = client.submit(tasks.model_facts, self.spec, pure=False).result()
        # Seeds every block key: HMAC of the fingerprint with the namespace's secret.
        self.key_digest = keyed_digest(self.facts.fingerprint.digest, config.get("secret", secret))
        self.tokenizer = load_tokenizer(model)
        self.bandwidth_override: float | None = None  # bytes/s for every pair (what-if, tests)
        self.prefill_override = None  # a PrefillProfile for every worker (what-if, tests)
        self.decisions: deque[Decision] = deque(maxlen=1024)  # cost-model decisions, oldest first
        self.parallel_plans: deque = deque(maxlen=256)  # parallel-prefill choices (ParallelPlan), oldest first

    # -- plumbing -------------------------------------------------------------------------
    def _rpc(self, name: str, **kwargs):
        """A call to the KV plugin, on behalf of this runtime's session."""
        return self.client.sync(getattr(self.client.scheduler, name), session=self.session.token, **kwargs)

    @property
    def fingerprint(self):
        return self.facts.fingerprint

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def configure(self, kv_budget_bytes: int | None = None, memory_weight: float | None = None, unset_budget=False):
        kv_budget_bytes = validation.optional("kv_budget_bytes", kv_budget_bytes, validation.byte_size, minimum=0)
        memory_weight = validation.optional("memory_weight", memory_weight, validation.number, minimum=0)
        self._rpc("kv_configure", kv_budget_bytes=kv_budget_bytes, memory_weight=memory_weight, unset_budget=unset_budget)

    def view(self) -> ClusterView:
        snap = self._rpc("kv_snapshot")
        return ClusterView.from_snapshot(snap, self.bandwidth_override, self.prefill_override)

    def _check(self, state: DistKVState, name: str = "state") -> None:
        validation.instance(name, state, DistKVState)
        if state.released:
            raise StateReleasedError(f"state {state.state_id} was released; materialize it again")
        compat.check_state_for_model(state.state, self.fingerprint, self.block_size)

    # -- block references -------------------------------------------------------------------
    def _hold(self, keys) -> dict[str, Future]:
        """Futures for keys the plugin has just acquired for this client."""
        return hold_futures(self.client, keys)

    def _lookup(self, tokens: Sequence[int]) -> _Match:
        """The longest cached prefix of ``tokens`` in this namespace, asked by its own chain keys."""
        full = aligned_floor(len(tokens), self.block_size)
        keys = [k for k, _, _ in chain_keys(self.key_digest, tokens[:full], self.block_size)]
        ans = self._rpc("kv_lookup", root=self.key_digest, keys=keys, tokens=list(tokens),
                        block_size=self.block_size, client=self.client.id)
        return _Match(ans["tokens"], ans["blocks"], self._hold(b["key"] for b in ans["blocks"]), tokens)

    def _publish(self, make: Callable[[int], tuple], tokens, kept, spans, sid: str, worker,
                 store: bool = False, source: str | None = None) -> tuple:
        """The state's blocks: ``kept`` (ref, future) pairs, then one key per new span.

        ``make(i)`` gives the (function, *args) of a task producing span i's tensor on
        ``worker`` (one for all spans, or one per span), where its input is. A span whose content address the scheduler already
        knows is acquired instead of submitted. ``store``: new blocks are also written to the
        persistent store (by that task, in the background); ``source="store"``: they were
        loaded from it.
        """
        return self._publish_many([(make, tokens, kept, spans, sid, worker)], store, source)[0]

    def _publish_many(self, items, store: bool = False, source: str | None = None) -> list[tuple]:
        """``_publish`` for several states at once: one acquire for all their new blocks.

        ``items``: (make, tokens, kept, spans, state id, worker) per state, ``worker`` one
        for all spans or one per span (a parallel prefill's chunks). Two states with the same
        continuation share its blocks' keys and get the same futures.
        """
        plans = []
        for make, tokens, kept, spans, sid, worker in items:
            parent = kept[-1][0].key if kept else None
            planned = []
            for s, e in spans:
                key = block_key(self.key_digest, parent, tokens[s:e])
                planned.append((BlockRef(key, s, tuple(tokens[s:e]), (e - s) * self.facts.bytes_per_token), parent))
                parent = key
            plans.append(planned)
        keys = list(dict.fromkeys(r.key for planned in plans for r, _ in planned))
        held = self._hold(self._rpc("kv_acquire", keys=keys, client=self.client.id) if keys else {})
        out = []
        for (make, tokens, kept, spans, sid, worker), planned in zip(items, plans):
            where = list(worker) if isinstance(worker, (list, tuple)) else [worker] * len(spans)
            refs, futures = [r for r, _ in kept], [f for _, f in kept]
            for i, (ref, parent) in enumerate(planned):
                if ref.key not in held:
                    meta = self._block_meta(ref, parent, sid)
                    if source:
                        meta["source"] = source
                    if store:
                        meta["persist"] = True
                    task = make(i) + ((self._write_request(ref.key, ref.start, ref.end),) if store else ())
                    with dask.annotate(kv={"role": "block", "session": self.session.token, "meta": meta}):
                        held[ref.key] = self._submit_near(where[i], *task, key=ref.key)
                refs.append(ref)
                futures.append(held[ref.key])
            out.append((refs, futures))
        return out

    def _submit_near(self, worker: str | None, fn, *args, key: str) -> Future:
        """Submit a task that reads a prefill's output where that output is.

        The restriction keeps Dask from treating these many small, few-input tasks as
        root-ish (queued on whichever worker is free) and work stealing from moving them,
        either of which would move the output instead. If the worker dies the plugin
        loosens it and they run wherever Dask recomputes their input.
        """
        return self.client.submit(fn, *args, key=key, workers=[worker] if worker else None, pure=False)

    def _block_meta(self, ref: BlockRef, parent: str | None, state_id: str) -> dict:
        return {
            "key": ref.key,
            "start": ref.start,
            "end": ref.end,
            "nbytes": ref.nbytes,
            "tokens": list(ref.token_ids),
            "parent": parent,
            "fingerprint": self.fingerprint.digest,
            "root": self.key_digest,
            "state_id": state_id,
            "device": self.spec.device,
        }

    def _state(self, sid, refs, futures, op, parents: Sequence[DistKVState], worker, **detail) -> DistKVState:
        return self._states([(sid, refs, futures, op, parents, worker, detail)])[0]

    def _states(self, specs) -> list[DistKVState]:
        """New states, registered with the plugin in one call. ``specs``: (state id, refs,
        futures, op, parent states, worker, lineage detail) per state."""
        descs, details, handles = [], [], []
        for sid, refs, futures, op, parents, worker, detail in specs:
            event = LineageEvent(op, sid, tuple(p.state_id for p in parents), tuple(sorted(detail.items())))
            history = tuple(dict.fromkeys(ev for p in parents for ev in p.state.lineage))
            desc = KVState(sid, self.fingerprint, self.block_size, tuple(refs), history + (event,), self.spec.device,
                           worker)
            descs.append(desc)
            details.append(detail)
            handles.append(DistKVState(desc, tuple(futures), self))
        self._register(descs, details)
        return handles

    def _register(self, descs: Sequence[KVState], details: Sequence[dict] | None = None) -> None:
        details = details or [{}] * len(descs)
        metas = [
            {
                "state_id": d.state_id,
                "block_keys": list(d.block_keys),
                "op": d.lineage[-1].op if d.lineage else "",
                "parents": list(d.lineage[-1].parents) if d.lineage else [],
                "tokens": d.length,
                "worker": d.worker,
                **{k: v for k, v in detail.items() if k in ("tokens_reused", "tokens_computed")},
            }
            for d, detail in zip(descs, details)
        ]
        self._rpc("kv_register_states", metas=metas)

    # -- prefill --------------------------------------------------------------------------
    def _plan(self, view, match: _Match, reused, n, policy, worker=None, workers=None, new_tokens=None,
              max_new_tokens=1):
        """plan_placements, calibrating first if the cost model lacks a measurement."""
        args = (match.plan_input(), reused, n, policy, worker, workers, new_tokens, max_new_tokens)
        try:
            return plan_placements(view, *args), view
        except NeedsCalibration:
            self.calibrate()
            view = self.view()
            return plan_placements(view, *args), view

    def _reusable(self, reused: int) -> int:
        """``ModelRunner.reusable`` on this side: below fp32 only whole blocks are reused."""
        return reusable_prefix(reused, self.block_size, self.facts.aligned_prefill)

    def _predict(self, view, worker, reused: int, new_tokens: list[int], max_new_tokens: int) -> float | None:
        """Seconds a compute task's plan expects it to run (the plugin tells later plans how
        long ``worker`` stays busy)."""
        prof = view.profile(worker) if worker else None
        return None if prof is None else batch_seconds(prof, reused, new_tokens, max_new_tokens)

    def _record(self, p: Placement) -> None:
        if p.first and p.decision is not None:  # one decision per destination, not per branch
            self.decisions.append(p.decision)

    def _prefill_task(self, req: tasks.PrefillRequest, inputs, worker, reads=(), placement=None,
                      predicted_s=None) -> Future:
        return self._compute_task(tasks.prefill, req, inputs, task_key(PREFILL, req.op, req.state_id), req.op,
                                  req.state_id, worker, reads, placement, predicted_s=predicted_s)

    def _batch_task(self, breq: tasks.BatchPrefillRequest, inputs, worker, reads=(), placement=None,
                    predicted_s=None) -> Future:
        """One ``prefill_batch`` for several branches of one prefix on one worker."""
        return self._compute_task(tasks.prefill_batch, breq, inputs, task_key(PREFILL, breq.op, breq.batch_id),
                                  breq.op, breq.batch_id, worker, reads, placement, predicted_s=predicted_s,
                                  branches=[r.state_id for r in breq.requests])

    def _compute_task(self, fn, req, inputs, key, op, state_id, worker, reads=(), placement=None, kv_out=None,
                      **extra) -> Future:
        note = {
            "role": "compute",
            "session": self.session.token,
            "op": op,
            "state_id": state_id,
            "target": worker,
            "reads": list(reads),
            "decision": None if placement is None else placement.decision_dict(),
            "first": bool(placement is not None and placement.first),
            # what the task adds to its worker (admission, see kv_budget)
            "kv_out": self._out_bytes(req) if kv_out is None else kv_out,
            **extra,
        }
        with dask.annotate(kv=note):
            return self.client.submit(
                fn,
                self.spec,
                req,
                *inputs,
                key=key,
                workers=[worker] if worker else None,  # strict; the plugin loosens it if worker dies
                pure=False,
            )

    def _out_bytes(self, req) -> int:
        """KV bytes a prefill's output blocks can hold at most: from the aligned floor of what
        it reuses to the end of its prompt and generation."""
        reqs = req.requests if isinstance(req, tasks.BatchPrefillRequest) else (req,)
        return sum((len(r.tokens) + r.max_new_tokens - aligned_floor(r.reused, self.block_size))
                   * self.facts.bytes_per_token for r in reqs)

    def _inputs(self, match: _Match, p: Placement, tokens, replicas: dict, view=None) -> tuple[list, list[str]]:
        """(prefix block futures, keys read from the cache) for a consumer placed by ``p``."""
        if p.action == "recompute":  # rebuild the prefix on the destination, once per worker
            slot = (id(match), p.worker)
            if slot not in replicas:
                need = max(p.recompute_tokens, p.reused)
                replicas[slot] = self._replica(tokens[:need], p.worker, match, p.held_tokens, view)
            return list(replicas[slot]), []
        reads = [b["key"] for b in read_blocks(match.plan_input(), p.reused)]
        return [match.futures[k] for k in reads], reads

    def _replica(self, tokens: list[int], worker: str, match: _Match, held: int = 0, view=None) -> tuple[Future, ...]:
        """Rebuild a prefix on ``worker`` from the ``held`` leading tokens it already holds
        (partial recompute): its own blocks are read in place, only the rest is prefilled,
        into private blocks freed after their readers."""
        sid = new_state_id("recompute")
        own = [match.futures[b["key"]] for b in match.blocks if b["end"] <= held]  # held is block-aligned
        predicted = self._predict(view, worker, held, [len(tokens) - held], 0) if view else None
        out = self._prefill_task(tasks.PrefillRequest(tuple(tokens), held, op="recompute", state_id=sid), own, worker,
                                 predicted_s=predicted)
        n = len(split_spans(aligned_floor(held, self.block_size), len(tokens), self.block_size))
        return tuple(own) + tuple(self._submit_near(worker, tasks.take_block, out, i,
                                                    key=task_key(REPLICA, sid, i)) for i in range(n))

    def materialize(self, tokens: Sequence[int] | str, worker: str | None = None, parallel: int | str | None = None
                    ) -> DistKVState:
        """Prefill ``tokens`` once (reusing any cached prefix, on any worker).

        ``parallel``: workers the prefill is split over (``parallel_materialize``): 1 = one
        worker; W = W workers, each prefilling a chunk while handing its K/V forward layer by
        layer; "auto" (or None: ``daskflow-kv.parallel.materialize``, "auto" by default) lets
        the planner choose W from the fitted prefill profile, the links and the idle workers,
        and it keeps one worker unless more are predicted faster. The blocks are the same
        keys whatever W, each on the worker that computed it. ``worker``: where a single
        prefill runs (with W > 1, one of the W).
        """
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.facts.vocab_size, allow_empty=False)
        parallel = parallel_materialize.width(parallel)
        if worker is not None and parallel == "auto":
            parallel = 1  # a caller who names the worker asked for that worker
        return self._materialize(tokens, "materialize", (), worker, parallel)

    def _materialize(self, tokens, op, parents, worker=None, parallel=1, **detail) -> DistKVState:
        compat.check_positions(0, len(tokens), 0, self.facts.max_positions)
        sid = new_state_id(op)
        match = self._lookup(tokens)
        in_memory = match.tokens
        match = self._from_store(tokens, match, worker, sid)  # a miss in memory may hit the store
        reused = match.tokens
        if reused < len(tokens):  # a prefill follows: below fp32 it starts on a block boundary
            reused = self._reusable(reused)
        floor = aligned_floor(reused, self.block_size)
        if reused > in_memory:
            detail["tokens_from_store"] = reused - in_memory
        target = None  # where the new blocks are made (the last chunk's worker, when split)
        width = 1
        if reused < len(tokens):
            view = self.view()
            [p], view = self._plan(view, match, [reused], 1, "pin", worker, None, [len(tokens) - reused], 0)
            self._record(p)
            split = parallel_materialize.plan(self, view, p.worker, reused, len(tokens), reused, parallel)
            if split is not None:  # every chunk reads the cached prefix where it is (Dask moves it)
                reads = [b["key"] for b in read_blocks(match.plan_input(), reused)]
                make, spans, target = parallel_materialize.submit(
                    self, split, tokens, reused, [match.futures[k] for k in reads], reads, sid, op)
                width = split.width
            else:
                inputs, reads = self._inputs(match, p, tokens, {}, view)
                req = tasks.PrefillRequest(tuple(tokens), reused, op=op, state_id=sid)
                source = self._prefill_task(req, inputs, p.worker, reads, p,
                                            self._predict(view, p.worker, reused, [len(tokens) - reused], 0))
                make, spans, target = ((lambda i: (tasks.take_block, source, i)),
                                       split_spans(floor, len(tokens), self.block_size), p.worker)
        elif floor < reused:  # all cached; the request ends inside a cached block: cut it, no prefill
            tail = match.futures[match.blocks[-1]["key"]]
            target = next(iter(match.blocks[-1]["where"]), None)
            make, spans = (lambda i: (tasks.cut_block, tail, reused - floor)), [(floor, reused)]
        else:
            make, spans = None, []
        writes = self._writes(op)
        refs, futures = self._publish(make, tokens, match.kept(floor), spans, sid, target, store=writes)
        if writes:  # a shared state is stored whole, reused blocks too: a gap would cut it short
            self._write_reused(match, floor)
        if width > 1:
            detail["parallel"] = width
            target = target[-1]
        return self._state(sid, refs, futures, op, parents, target,
                           tokens_reused=reused, tokens_computed=len(tokens) - reused, **detail)

    # -- operators ------------------------------------------------------------------------
    def fork(self, state: DistKVState, k: int) -> list[DistKVState]:
        """k children sharing the parent's block futures; no task, no copy."""
        self._check(state)
        k = validation.fork_count("k", k)
        children = [state.state.derive("fork", (state.state_id,), branch=i, of=k) for i in range(k)]
        self._register(children)
        return [DistKVState(c, state.futures, self) for c in children]

    def extend(self, state: DistKVState, tokens: Sequence[int]) -> DistKVState:
        self._check(state)
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.facts.vocab_size, allow_empty=False)
        return self._materialize(list(state.tokens) + tokens, "extend", (state,))

    def resume(self, state: DistKVState, suffix: Sequence[int] = (), max_new_tokens: int = 32, **kw) -> DistGeneration:
        return self.resume_many([(state, suffix)], max_new_tokens, **kw)[0]

    def resume_many(
        self,
        requests: Sequence[tuple[DistKVState, Sequence[int]]],
        max_new_tokens: int = 32,
        sampling: SamplingParams = GREEDY,
        policy: str = "auto",
        workers: Sequence[str] | None = None,
        return_logits: bool = False,
        batch: bool = True,
    ) -> list[DistGeneration]:
        """Resume several branches in parallel, placed across workers by the cost model.

        policy: auto (cost model per destination) | transfer | recompute (forced for every
        destination that lacks the blocks) | pin (every branch runs where its blocks are).
        ``workers`` limits the workers branches spread over. ``batch``: branches of one
        state placed on the same worker run as one ``prefill_batch`` task (one copy of the
        prefix, decoded together; the same tokens); False runs one ``prefill`` per branch.
        """
        max_new_tokens = validation.max_new_tokens("max_new_tokens", max_new_tokens)
        validation.instance("sampling", sampling, SamplingParams)
        validation.choice("policy", policy, POLICIES)
        requests = [(s, self.encode(x) if isinstance(x, str) else x) for s, x in validation.pairs("requests", requests)]
        prompts = []
        for i, (state, suffix) in enumerate(requests):
            self._check(state, f"requests[{i}] state")
            suffix = validation.token_ids(f"requests[{i}] suffix", suffix, self.facts.vocab_size)
            compat.check_positions(state.length, len(suffix), max_new_tokens, self.facts.max_positions)
            prompts.append(list(state.tokens) + list(suffix))

        # Plan: branches over the same blocks share one lookup, so each destination worker
        # gets one decision and Dask moves (or the plan rebuilds) each block once per worker.
        groups: dict[tuple, list[int]] = {}
        for i, (state, _) in enumerate(requests):
            groups.setdefault(state.state.block_keys, []).append(i)
        view = self.view()
        plans: list[tuple[_Match, Placement]] = [None] * len(requests)  # type: ignore[list-item]
        for idxs in groups.values():
            match = self._lookup(requests[idxs[0]][0].tokens)
            # decode needs >= 1 fed token; below fp32 a prefill starts on a block boundary
            reused = [self._reusable(min(match.tokens, len(prompts[i]) - 1)) for i in idxs]
            new = [len(prompts[i]) - r for i, r in zip(idxs, reused)]
            placements, view = self._plan(view, match, reused, len(idxs), policy, None, workers, new, max_new_tokens)
            for i, p in zip(idxs, placements):
                plans[i] = (match, p)
            for p in placements:  # the next group's plan sees this one's work queued
                if p.worker in view.workers:
                    view.workers[p.worker] = {**view.workers[p.worker], "busy_s": max(view.busy(p.worker), p.finish_s)}

        replicas: dict = {}
        sids = [new_state_id("resume") for _ in plans]
        reqs = [
            tasks.PrefillRequest(tuple(prompts[i]), p.reused, max_new_tokens, sampling, i, return_logits, "resume",
                                 sids[i])
            for i, (_, p) in enumerate(plans)
        ]
        # Branches that read the same prefix (same match, same reused tokens, same inputs) on
        # the same worker share one batched task; a lone branch keeps the plain prefill. A
        # model whose attention batched resume cannot reproduce resumes branch by branch,
        # decided here, before anything is submitted.
        batch = batch and self.facts.batch_unsupported is None
        batches: dict[tuple, list[int]] = {}
        for i, (match, p) in enumerate(plans):
            self._record(p)
            slot = (id(match), p.reused, p.worker, p.action) if batch and p.worker else ("single", i)
            batches.setdefault(slot, []).append(i)
        outputs: list[Future] = [None] * len(plans)  # type: ignore[list-item]
        wanted: list[tuple[list[int], Future]] = []  # (branches, future of their small results)
        for idxs in batches.values():
            match, p = plans[idxs[0]]
            inputs, reads = self._inputs(match, p, prompts[idxs[0]], replicas, view)
            predicted = self._predict(view, p.worker, p.reused, [len(prompts[i]) - p.reused for i in idxs],
                                      max_new_tokens)
            if len(idxs) == 1:
                [i] = idxs
                outputs[i] = self._prefill_task(reqs[i], inputs, p.worker, reads, p, predicted)
                wanted.append((idxs, self._submit_near(p.worker, tasks.take_result, outputs[i],
                                                       key=task_key(RESULT, sids[i]))))
                continue
            first = next((plans[i][1] for i in idxs if plans[i][1].first), p)  # carries the destination's decision
            breq = tasks.BatchPrefillRequest(tuple(reqs[i] for i in idxs), p.reused, "resume", f"batch-{sids[idxs[0]]}")
            out = self._batch_task(breq, inputs, p.worker, reads, first, predicted)
            for j, i in enumerate(idxs):
                outputs[i] = self._submit_near(p.worker, tasks.take_branch, out, j,
                                               key=task_key(PREFILL, "branch", sids[i]))
            # One small-results task per batch, not one per branch (each is a scheduler round trip).
            wanted.append((idxs, self._submit_near(p.worker, tasks.take_batch_results, out,
                                                   key=task_key(RESULT, "batch", sids[idxs[0]]))))
            del out  # the branch outputs hold the batch now; Dask frees it once they are computed
        replicas.clear()  # the consumers depend on the replica blocks now; Dask frees them after
        results: list = [None] * len(plans)
        for (idxs, _), got in zip(wanted, self.client.gather([f for _, f in wanted])):
            for i, res in zip(idxs, got if isinstance(got, list) else [got]):
                results[i] = res

        # Every continuation's blocks in one acquire, every state in one register: per-branch
        # calls cost two scheduler round trips each (a third of a k=16 resume's wall, measured).
        items = []
        for prompt, out, res, (match, p), sid in zip(prompts, outputs, results, plans, sids):
            fed = prompt + res.generated[:-1]  # the last sampled token was never fed
            floor = aligned_floor(p.reused, self.block_size)
            items.append((lambda j, out=out: (tasks.take_block, out, j), fed, match.kept(floor),
                          split_spans(floor, len(fed), self.block_size), sid, res.worker))
        published = self._publish_many(items, store=self._writes("resume"))
        conts = self._states([
            (sid, refs, futures, "resume", (state,), res.worker,
             {"placement": p.action, "tokens_reused": p.reused, "tokens_computed": len(prompt) - p.reused})
            for (state, _), prompt, res, (_, p), sid, (refs, futures)
            in zip(requests, prompts, results, plans, sids, published)
        ])
        gens = []
        for res, (_, p), cont in zip(results, plans, conts):
            # The prefix rebuilt on a "recompute" destination is charged to its first branch.
            metrics = {**res.metrics, "tokens_recomputed": p.recompute_tokens}
            gens.append(DistGeneration(res.generated, self.decode(res.generated), metrics, res.worker, p, cont,
                                       res.logits))
        return gens

    def merge(self, a: DistKVState, b: DistKVState, how: str = "auto") -> DistKVState:
        """Exact combinations only; see Engine.merge for the rules."""
        validation.choice("how", how, ("auto", "concat", "text"))
        self._check(a, "a")
        self._check(b, "b")
        validation.distinct_states("merge", a.state_id, b.state_id)
        compat.check_pair(a.state, b.state)
        if how in ("auto", "concat"):
            try:
                compat.check_concat(a.state, b.state)
                child = b.state.derive("merge", (a.state_id, b.state_id), how="concat")
                self._register([child])
                return DistKVState(child, b.futures, self)
            except MergeError:
                if how == "concat":
                    raise
        p = common_prefix_len(a.tokens, b.tokens)
        extra = list(b.tokens[p:])
        if not extra:
            raise MergeError(f"cannot merge {a.state_id} and {b.state_id}", ["b adds nothing after a"])
        return self._materialize(list(a.tokens) + extra, "merge", (a, b), how="text", reduced_tokens=len(extra))

    def release(self, state: DistKVState) -> None:
        """Drop this handle's references; cached blocks stay until evicted under the budget."""
        validation.instance("state", state, DistKVState)
        if state.released:
            return
        state.released = True
        state.futures = ()  # forks share the tuple: the blocks go only when no handle holds it
        self._rpc("kv_release_state", state_id=state.state_id)

    # -- baseline and introspection ---------------------------------------------------------
    def generate_text(self, tokens: Sequence[int] | str, max_new_tokens: int = 32, sampling: SamplingParams = GREEDY,
                      stream: int = 0, worker: str | None = None, return_logits: bool = False) -> Future:
        """Text mode on a worker: the whole prompt prefilled from nothing. A future of GenerationResult."""
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.facts.vocab_size, allow_empty=False)
        max_new_tokens = validation.max_new_tokens("max_new_tokens", max_new_tokens)
        validation.instance("sampling", sampling, SamplingParams)
        stream = validation.integer("stream", stream, minimum=0)
        compat.check_positions(0, len(tokens), max_new_tokens, self.facts.max_positions)
        return self.client.submit(tasks.text_generate, self.spec, tokens, max_new_tokens, sampling, stream,
                                  return_logits, workers=[worker] if worker else None, pure=False)

    def counters(self) -> dict:
        return self._rpc("kv_counters")

    def catalog(self):
        """The plugin's catalog as a pyarrow Table, one row per (state, block)."""
        from ..state.catalog import rows_to_arrow

        return rows_to_arrow(self._rpc("kv_catalog"))

    def explain(self) -> str:
        lines = [explain(d) for d in self.decisions]
        lines += [f"parallel prefill over {p.width}: {p.reason}" for p in self.parallel_plans]
        return "\n".join(lines + ([self.explain_store()] if self.store_decisions else []))

    def wait(self, states: Sequence[DistKVState], timeout=None) -> None:
        wait([f for s in states for f in s.futures], timeout=timeout)

    def calibrate(self, probe_bytes: int | str | None = None, probe_tokens: int | None = None) -> dict:
        """Measure every worker pair's bandwidth and every worker's prefill speed (config:
        ``daskflow-kv.calibration``)."""
        from .calibration import calibrate

        out = calibrate(self, probe_bytes, probe_tokens)
        if self.store is not None:
            out["store"] = self.calibrate_store()
        return out
