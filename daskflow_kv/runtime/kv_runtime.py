"""KV states as Dask futures: materialize, fork, resume, extend, merge across workers.

``KVRuntime`` is the distributed counterpart of ``Engine``. Blocks are Dask keys (their
content addresses) held in worker memory; a ``DistKVState`` is a descriptor plus the
futures that keep its blocks alive. Every prefill first asks the scheduler plugin for the
longest cached prefix (any client's), then the planner decides per destination worker
whether the consumer reuses local blocks, fetches them (Dask moves them once per worker)
or recomputes them there, using the cost model fed with measured bandwidth and prefill
profiles. Decisions travel as task annotations; the plugin turns them into restrictions.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Sequence

import dask
from distributed import Client, Future, wait

from .. import compat
from ..blocks import DEFAULT_BLOCK_SIZE, BlockRef, aligned_floor, block_key, common_prefix_len
from ..cost_model import Decision, explain
from ..errors import MergeError, StateReleasedError
from ..kv_state import KVState, LineageEvent, new_state_id
from ..sampling import GREEDY, SamplingParams
from . import tasks
from ..cost_model import NeedsCalibration
from .planner import ClusterView, Placement, plan_placements
from .serialization import TorchSerializationPlugin


@dataclass(eq=False)
class DistKVState:
    """A KV state whose blocks are futures pinned to workers."""

    state: KVState  # the descriptor (fingerprint, blocks, lineage)
    futures: tuple[Future, ...]  # one per block; holding them keeps the blocks alive
    runtime: "KVRuntime" = field(repr=False)
    released: bool = False

    @property
    def state_id(self) -> str:
        return self.state.state_id

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.state.tokens

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def who_has(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.runtime.client.who_has(list(self.futures)).items()}

    def release(self) -> None:
        self.runtime.release(self)


@dataclass
class DistGeneration:
    tokens: list[int]  # generated ids
    text: str
    metrics: dict  # RunMetrics of the prefill + decode, measured on the worker
    worker: str  # where it ran
    placement: Placement  # the plan's decision for this branch
    state: DistKVState | None = None  # continuation state (its blocks on ``worker``)
    logits: object = None


class KVRuntime:
    def __init__(
        self,
        client: Client,
        model: str = "tiny-llama",
        dtype: str = "float32",
        block_size: int = DEFAULT_BLOCK_SIZE,
        namespace: str = "",
        device: str = "cpu",
        kv_budget_bytes: int | None = None,
        memory_weight: float = 0.0,
    ):
        from ..models.loader import load_tokenizer
        from ..plugins.kv_scheduler import KVSchedulerPlugin

        self.client = client
        self.spec = tasks.ModelSpec(model, str(dtype).removeprefix("torch."), block_size, namespace, device)
        client.register_plugin(TorchSerializationPlugin())
        if not client.run_on_scheduler(_has_kv_plugin):
            client.register_plugin(KVSchedulerPlugin(kv_budget_bytes, memory_weight))
        elif kv_budget_bytes is not None or memory_weight:
            self.configure(kv_budget_bytes=kv_budget_bytes, memory_weight=memory_weight)
        self.facts: tasks.ModelFacts = client.submit(tasks.model_facts, self.spec, pure=False).result()
        self.tokenizer = load_tokenizer(model)
        self.bandwidth_override: float | None = None  # bytes/s for every pair (what-if, tests)
        self.prefill_override = None  # a PrefillProfile for every worker (what-if, tests)
        self.decisions: list[Decision] = []  # this runtime's cost-model decisions, in order

    # -- plumbing -------------------------------------------------------------------------
    def _rpc(self, name: str, **kwargs):
        return self.client.sync(getattr(self.client.scheduler, name), **kwargs)

    @property
    def fingerprint(self):
        return self.facts.fingerprint

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def configure(self, kv_budget_bytes: int | None = None, memory_weight: float | None = None, unset_budget=False):
        self._rpc("kv_configure", kv_budget_bytes=kv_budget_bytes, memory_weight=memory_weight, unset_budget=unset_budget)

    def view(self) -> ClusterView:
        snap = self._rpc("kv_snapshot")
        return ClusterView.from_snapshot(snap, self.bandwidth_override, self.prefill_override)

    def _check(self, state: DistKVState) -> None:
        if state.released:
            raise StateReleasedError(f"state {state.state_id} was released; materialize it again")
        compat.check_state_for_model(state.state, self.fingerprint, self.block_size)

    # -- prefill --------------------------------------------------------------------------
    def _lookup(self, tokens: list[int]) -> dict:
        return self._rpc(
            "kv_lookup", fingerprint=self.fingerprint.digest, tokens=list(tokens), block_size=self.block_size
        )

    def _block_meta(self, ref: BlockRef, parent: str | None, state_id: str) -> dict:
        return {
            "key": ref.key,
            "start": ref.start,
            "end": ref.end,
            "nbytes": ref.nbytes,
            "tokens": list(ref.token_ids),
            "parent": parent,
            "fingerprint": self.fingerprint.digest,
            "state_id": state_id,
            "device": self.spec.device,
        }

    def _publish(self, output: Future | None, tokens, kept: list[BlockRef], spans, state_id: str, target) -> tuple:
        """Block futures for ``kept`` (existing keys) plus one take_block task per new span."""
        futures = [Future(b.key, self.client) for b in kept]
        refs = list(kept)
        parent = kept[-1].key if kept else None
        for i, (s, e) in enumerate(spans):
            key = block_key(self.fingerprint.digest, parent, tokens[s:e])
            ref = BlockRef(key, s, tuple(tokens[s:e]), (e - s) * self.facts.bytes_per_token)
            with dask.annotate(kv={"role": "block", "meta": self._block_meta(ref, parent, state_id)}):
                if isinstance(output, tuple):  # cut from a cached block, no prefill
                    fut = self.client.submit(tasks.cut_block, output[0], output[1], key=key, pure=False)
                else:
                    fut = self.client.submit(tasks.take_block, output, i, key=key, pure=False)
            futures.append(fut)
            refs.append(ref)
            parent = key
        return refs, futures

    def _state(self, sid, refs, futures, op, parents: Sequence[DistKVState], worker, **detail) -> DistKVState:
        event = LineageEvent(op, sid, tuple(p.state_id for p in parents), tuple(sorted(detail.items())))
        history = tuple(dict.fromkeys(ev for p in parents for ev in p.state.lineage))
        desc = KVState(sid, self.fingerprint, self.block_size, tuple(refs), history + (event,), self.spec.device, worker)
        self._rpc(
            "kv_register_state",
            meta={
                "state_id": sid,
                "block_keys": list(desc.block_keys),
                "op": op,
                "parents": list(event.parents),
                "tokens": desc.length,
                "worker": worker,
            },
        )
        return DistKVState(desc, tuple(futures), self)

    def _submit_prefill(self, tokens, match, placement: Placement, max_new, sampling, stream, return_logits, op, sid):
        reused = placement.reused
        reads = [b["key"] for b in match["blocks"] if b["start"] < reused]
        deps = [Future(k, self.client) for k in reads]
        if placement.replica is not None:  # recompute on dst: read the dst-local replica instead
            deps = list(placement.replica)
        note = {
            "role": "compute",
            "op": op,
            "state_id": sid,
            "target": placement.worker,
            "reads": reads if placement.replica is None else [],
            "decision": placement.decision_dict(),
        }
        with dask.annotate(kv=note):
            return self.client.submit(
                tasks.prefill,
                self.spec,
                list(tokens),
                reused,
                max_new,
                sampling,
                stream,
                return_logits,
                *deps,
                key=f"kvprefill-{op}-{sid}",
                workers=[placement.worker] if placement.worker else None,
                allow_other_workers=bool(placement.worker),
                pure=False,
            )

    def materialize(self, tokens: Sequence[int] | str, worker: str | None = None) -> DistKVState:
        """Prefill ``tokens`` once on a worker (reusing any cached prefix, on any worker)."""
        tokens = self.encode(tokens) if isinstance(tokens, str) else list(tokens)
        if not tokens:
            raise ValueError("materialize needs at least one token")
        return self._materialize(tokens, "materialize", (), worker)

    def _materialize(self, tokens, op, parents, worker=None, **detail) -> DistKVState:
        compat.check_tokens(tokens, self.facts.vocab_size)
        compat.check_positions(0, len(tokens), 0, self.facts.max_positions)
        match = self._lookup(tokens)
        reused = match["tokens"]
        floor = aligned_floor(reused, self.block_size)
        kept = [_ref(b) for b in match["blocks"] if b["end"] <= floor]
        sid = new_state_id(op)
        if reused < len(tokens):
            [placement], _ = self._plan(self.view(), match, [reused], 1, "pin", worker)
            self.decisions.append(placement.decision)
            output = self._submit_prefill(tokens, match, placement, 0, GREEDY, 0, False, op, sid)
            spans = [(s, min(s + self.block_size, len(tokens))) for s in range(floor, len(tokens), self.block_size)]
            target = placement.worker
        elif floor < reused:  # all cached; the request ends inside a cached block
            tail = match["blocks"][-1]
            output, spans, target = (Future(tail["key"], self.client), reused - floor), [(floor, reused)], None
        else:
            output, spans, target = None, [], None
        refs, futures = self._publish(output, tokens, kept, spans, sid, target)
        return self._state(sid, refs, futures, op, parents, target, tokens_reused=reused, tokens_computed=len(tokens) - reused, **detail)

    def _plan(self, view, match, reused, n, policy, worker=None, workers=None):
        """plan_placements, calibrating first if the cost model lacks a measurement."""
        try:
            return plan_placements(view, match, reused, n, policy, worker, workers), view
        except NeedsCalibration:
            self.calibrate()
            view = self.view()
            return plan_placements(view, match, reused, n, policy, worker, workers), view

    # -- operators ------------------------------------------------------------------------
    def fork(self, state: DistKVState, k: int) -> list[DistKVState]:
        """k children sharing the parent's block futures; no task, no copy."""
        self._check(state)
        if k < 1:
            raise ValueError("fork needs k >= 1")
        out = []
        for i in range(k):
            child = state.state.derive("fork", (state.state_id,), branch=i, of=k)
            self._rpc(
                "kv_register_state",
                meta={"state_id": child.state_id, "block_keys": list(child.block_keys), "op": "fork",
                      "parents": [state.state_id], "tokens": child.length, "worker": child.worker},
            )
            out.append(DistKVState(child, state.futures, self))
        return out

    def extend(self, state: DistKVState, tokens: Sequence[int]) -> DistKVState:
        self._check(state)
        if not tokens:
            raise ValueError("extend needs at least one token")
        return self._materialize(list(state.tokens) + list(tokens), "extend", (state,))

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
    ) -> list[DistGeneration]:
        """Resume several branches in parallel, placed across workers by the cost model.

        policy: auto (cost model per destination) | transfer | recompute (forced for every
        branch placed away from the blocks) | pin (every branch runs where its blocks are).
        """
        if max_new_tokens < 1:
            raise ValueError("resume generates at least one token; use extend to only prefill")
        prompts, matches = [], []
        for state, suffix in requests:
            self._check(state)
            compat.check_tokens(suffix, self.facts.vocab_size)
            compat.check_positions(state.length, len(suffix), max_new_tokens, self.facts.max_positions)
            prompts.append(list(state.tokens) + list(suffix))
        view = self.view()
        placements, outputs, sids = [], [], []
        # Branches of one parent share a lookup: same blocks, same plan, one transfer per worker.
        groups: dict[tuple, list[int]] = {}
        for i, (state, _) in enumerate(requests):
            groups.setdefault(state.state.block_keys, []).append(i)
        for idxs in groups.values():
            match = self._lookup(prompts[idxs[0]][: requests[idxs[0]][0].length])
            reused = [min(match["tokens"], len(prompts[i]) - 1) for i in idxs]
            plan, view = self._plan(view, match, reused, len(idxs), policy, None, workers)
            replicas: dict[str, tuple] = {}  # one rebuild per destination worker, shared by its branches
            for i, placement in zip(idxs, plan):
                if placement.recompute_tokens:
                    replicas[placement.worker] = self._replica(prompts[i][: placement.recompute_tokens], placement.worker)
                if placement.decision is not None and placement.decision.action == "recompute":
                    placement.replica = replicas[placement.worker]
                matches.append((i, match, placement))
        matches.sort(key=lambda t: t[0])
        for i, match, placement in matches:
            sid = new_state_id("resume")
            self.decisions.append(placement.decision)
            outputs.append(
                self._submit_prefill(prompts[i], match, placement, max_new_tokens, sampling, i, return_logits, "resume", sid)
            )
            placements.append(placement)
            sids.append(sid)
        results = self.client.gather([self.client.submit(tasks.take_result, o, pure=False) for o in outputs])
        gens = []
        for (state, _), prompt, out_f, res, placement, sid in zip(requests, prompts, outputs, results, placements, sids):
            fed = prompt + res.generated[:-1]
            reused = placement.reused
            floor = aligned_floor(reused, self.block_size)
            match = next(m for i, m, p in matches if p is placement)
            kept = [_ref(b) for b in match["blocks"] if b["end"] <= floor]
            spans = [(s, min(s + self.block_size, len(fed))) for s in range(floor, len(fed), self.block_size)]
            refs, futures = self._publish(out_f, fed, kept, spans, sid, res.worker)
            cont = self._state(sid, refs, futures, "resume", (state,), res.worker,
                               tokens_reused=reused, tokens_computed=len(prompt) - reused)
            gens.append(DistGeneration(res.generated, self.decode(res.generated), res.metrics, res.worker,
                                       placement, cont, res.logits))
        return gens

    def _replica(self, tokens: list[int], worker: str) -> tuple[Future, ...]:
        """Recompute a prefix on ``worker`` (once per worker): private blocks, same content."""
        sid = new_state_id("recompute")
        note = {"role": "compute", "op": "recompute", "state_id": sid, "target": worker, "reads": []}
        with dask.annotate(kv=note):
            out = self.client.submit(tasks.prefill, self.spec, tokens, 0, 0, GREEDY, 0, False,
                                     key=f"kvprefill-recompute-{sid}", workers=[worker],
                                     allow_other_workers=True, pure=False)
        n = -(-len(tokens) // self.block_size)
        return tuple(self.client.submit(tasks.take_block, out, i, key=f"kvreplica-{sid}-{i}", pure=False)
                     for i in range(n))

    def merge(self, a: DistKVState, b: DistKVState, how: str = "auto") -> DistKVState:
        """Exact combinations only; see Engine.merge for the rules."""
        self._check(a)
        self._check(b)
        compat.check_pair(a.state, b.state)
        if how not in ("auto", "concat", "text"):
            raise ValueError(f"merge how={how!r}; expected auto, concat or text")
        if how in ("auto", "concat"):
            try:
                compat.check_concat(a.state, b.state)
                child = b.state.derive("merge", (a.state_id, b.state_id), how="concat")
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
        if not state.released:
            state.released = True
            self._rpc("kv_release_state", state_id=state.state_id)
            state.futures = ()

    # -- baseline and introspection ---------------------------------------------------------
    def generate_text(self, tokens: Sequence[int] | str, max_new_tokens: int = 32, sampling: SamplingParams = GREEDY,
                      stream: int = 0, worker: str | None = None, return_logits: bool = False):
        """Text mode on a worker: the whole prompt prefilled from nothing."""
        tokens = self.encode(tokens) if isinstance(tokens, str) else list(tokens)
        compat.check_tokens(tokens, self.facts.vocab_size)
        compat.check_positions(0, len(tokens), max_new_tokens, self.facts.max_positions)
        return self.client.submit(tasks.text_generate, self.spec, tokens, max_new_tokens, sampling, stream,
                                  return_logits, workers=[worker] if worker else None, pure=False)

    def counters(self) -> dict:
        return self._rpc("kv_counters")

    def catalog(self):
        from .catalog import rows_to_arrow

        return rows_to_arrow(self._rpc("kv_catalog"))

    def explain(self) -> str:
        return "\n".join(explain(d) for d in self.decisions if d is not None)

    def wait(self, states: Sequence[DistKVState]) -> None:
        wait([f for s in states for f in s.futures])

    def calibrate(self, probe_bytes: int = 32 << 20, probe_tokens: int = 256) -> dict:
        from .calibration import calibrate

        return calibrate(self, probe_bytes, probe_tokens)


def _has_kv_plugin(dask_scheduler) -> bool:
    from ..plugins.kv_scheduler import PLUGIN_NAME

    return PLUGIN_NAME in dask_scheduler.plugins


def _ref(b: dict) -> BlockRef:
    return BlockRef(b["key"], b["start"], tuple(b["tokens"]), b["nbytes"])
