"""The KV operators in one process: materialize, fork, resume, extend, merge, release.

``Engine`` joins a ``ModelRunner`` (tensors), a ``BlockStore`` (who holds which block) and
a ``PrefixIndex`` (which prefixes are cached). Every operator checks compatibility first,
then reuses the longest cached prefix and prefills only the rest. The Dask runtime runs
the same runner inside tasks; this class is the reference it must agree with.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import config, validation
from .errors import InvalidInputError, MergeError
from .model.emulated_profile import is_emulated
from .model.batched import BatchOutput, BatchStats, resume_batch
from .model.runner import ModelRunner, RunMetrics, RunOutput
from .model.sampling import GREEDY, SamplingParams
from .model.step_engine import StepEngine, StepRequest
from .model.text_codec import TextCodec
from .state import compat
from .state.block_store import BlockStore
from .state.blocks import BlockRef, aligned_floor, block_key, common_prefix_len
from .state.kv_state import KVState, LineageEvent, new_state_id
from .state.prefix_index import PrefixIndex


@dataclass(slots=True)
class Generation:
    tokens: list[int]  # generated token ids (EOS included if reached)
    text: str  # their decoded text
    logits: torch.Tensor | None  # [len(tokens), vocab] fp32 logits, if asked for
    metrics: RunMetrics  # timings and token counts
    state: KVState | None = None  # continuation state (state mode only)
    own_blocks: tuple[BlockRef, ...] = ()  # blocks the continuation added to its parent's


class ForkGenerations(list):
    """The ``Generation`` of every branch, in order, plus the batch's ``stats``."""

    stats: BatchStats | None = None


def _own_step_loop(runner) -> Callable[[list[StepRequest], bool], list[RunOutput]]:
    """``Engine.steps`` over a step loop of this engine's own (a model without weights has no
    ``resume_batch``: its forks share steps only there)."""
    loop = StepEngine(runner)
    return lambda requests, shared_prefix=False: [f.result() for f in loop.submit(requests, shared_prefix)]


class Engine:
    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype | None = None,
        block_size: int | None = None,
        namespace: str | None = None,
        device: str = "cpu",
        runner: ModelRunner | None = None,
        steps: Callable[[list[StepRequest], bool], list[RunOutput]] | None = None,
    ):
        """``steps``: runs step requests (``model.step_engine``) and returns their outputs, e.g.
        a worker's step loop (``runtime.step_worker.run``), so this engine's prefills and
        decodes share batches with other requests; None runs them here, one at a time."""
        block_size = validation.setting("block-size", block_size, "block_size", validation.block_size)
        if runner is None:
            from .model.zoo.loader import load_model
            from .model.zoo.names import check_model

            model = check_model(config.get("model", model), "model")
            dtype = validation.setting("dtype", dtype, "dtype", validation.dtype)
            if is_emulated(model):  # a profile, no weights (model.emulated_runner)
                from .model.emulated_runner import emulated_runner

                runner = emulated_runner(model, block_size, namespace)
            else:
                lm = load_model(model, dtype=dtype, device=device)
                runner = ModelRunner(lm.model, lm.tokenizer, lm.model_id, block_size, namespace)
        if steps is None and runner.model is None:  # emulated: resumes of forks run in a step loop of its own
            steps = _own_step_loop(runner)
        self.runner = runner
        self.steps = steps  # where prefills and decodes run (None: ModelRunner.run / resume_batch here)
        # Serializes the block store and prefix index: with ``steps``, threads of one process share
        # this engine and wait for their forwards concurrently (forwards run outside the lock).
        self._lock = threading.RLock()
        self.codec = TextCodec(runner.tokenizer)  # text <-> ids, as the runtime does it
        self.store = BlockStore()
        self.index = PrefixIndex()
        self._states: dict[str, KVState] = {}  # live descriptors by id, for lineage lookups

    # -- conveniences -----------------------------------------------------------------
    @property
    def fingerprint(self):
        return self.runner.fingerprint

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    # -- internals ----------------------------------------------------------------------
    def _check(self, state: KVState, name: str = "state") -> None:
        validation.instance(name, state, KVState)
        compat.check_state_for_model(state, self.fingerprint, self.block_size)
        self.store.require_live(state)

    def _publish(self, tokens, kept, new_blocks, op, parents, **detail) -> KVState:
        """Register a state made of ``kept`` (shared) blocks followed by freshly computed ones."""
        sid = new_state_id(op)
        parent_key = kept[-1].key if kept else None
        refs = list(kept)
        for start, end, tensor in new_blocks:
            key = block_key(self.fingerprint.digest, parent_key, tokens[start:end], self.fingerprint.namespace)
            ref = BlockRef(key, start, tuple(tokens[start:end]), tensor.numel() * tensor.element_size())
            self.store.put(key, tensor, owner=sid)
            self.index.add(ref, parent_key, self.fingerprint.digest)
            refs.append(ref)
            parent_key = key
        event = LineageEvent(op, sid, tuple(p.state_id for p in parents), tuple(sorted(detail.items())))
        history = tuple(dict.fromkeys(ev for p in parents for ev in p.lineage))
        state = KVState(sid, self.fingerprint, self.block_size, tuple(refs), history + (event,), str(self.runner.device))
        return self.store.register(state)

    def _prefill(
        self, tokens: list[int], op: str, parents: tuple[KVState, ...], max_new_tokens: int = 0, detail=None, **run_kw
    ):
        """Reuse the longest cached prefix of ``tokens``, prefill the rest, maybe decode.

        Returns (state, run output or None, tokens reused).
        """
        compat.check_positions(0, len(tokens), max_new_tokens, self.runner.max_positions)
        with self._lock:  # the lookup and the blocks it reads, held until the state is published
            match = self.index.longest_prefix(self.fingerprint.digest, tokens, self.block_size,
                                              self.fingerprint.namespace)
            # Decoding needs the last token's logits, which no cache holds: always feed >= 1 token.
            reused = min(match.tokens, len(tokens) - 1) if max_new_tokens else match.tokens
            if reused < len(tokens):  # a prefill follows: below fp32 it starts on a block boundary
                reused = self.runner.reusable(reused)
            floor = aligned_floor(reused, self.block_size)
            kept = [b for b in match.blocks if b.end <= floor]
            held = self.store.hold(b.key for b in match.blocks)
        try:
            out = None
            computed = len(tokens) - reused
            if reused < len(tokens):
                blocks = [self.store.get(b.key) for b in match.blocks if b.start < reused]
                out = self._run(blocks, reused, tokens[reused:], max_new_tokens, **run_kw)
                tokens = tokens + out.generated[:-1]
                new_blocks = out.new_blocks
            elif floor < reused:  # all cached, the tail inside a longer block: cut it out, no forward
                tail = match.blocks[-1]
                new_blocks = [(floor, reused, self.store.get(tail.key)[:, :, :, : reused - floor].contiguous())]
            else:
                new_blocks = []
            with self._lock:
                if not parents:  # plain materialize: the states whose blocks were reused are its parents
                    owners = dict.fromkeys(self.store.owner(b.key) for b in kept)
                    parents = tuple(self._states[o] for o in owners if o in self._states)
                state = self._publish(tokens, kept, new_blocks, op, parents, tokens_reused=reused,
                                      tokens_computed=computed, **(detail or {}))
                self._states[state.state_id] = state
        finally:
            with self._lock:
                self._drop(held)
        return state, out, reused

    def _run(self, blocks, reused: int, new_tokens: list[int], max_new_tokens: int, **run_kw) -> RunOutput:
        """One prefill (and decode): here, or in the step loop this engine was given."""
        if self.steps is None:
            return self.runner.run(blocks, reused, new_tokens, max_new_tokens, **run_kw)
        return self.steps([StepRequest(blocks, reused, new_tokens, max_new_tokens, **run_kw)], False)[0]

    def hold_prefix(self, tokens: Sequence[int]) -> tuple[int, list[str]]:
        """Reference the longest cached prefix of ``tokens`` until ``drop_hold``: (its length,
        the held block keys). A caller that admits work by the bytes it will add (a KV pool)
        keeps what it counted on from being evicted before the work starts."""
        with self._lock:
            match = self.index.longest_prefix(self.fingerprint.digest, tokens, self.block_size,
                                              self.fingerprint.namespace)
            return match.tokens, self.store.hold(b.key for b in match.blocks)

    def drop_hold(self, held: list[str]) -> None:
        """End a ``hold_prefix``."""
        with self._lock:
            self._drop(held)

    def _drop(self, held) -> None:
        for key in self.store.drop(held):
            self.index.remove(key)

    # -- operators ----------------------------------------------------------------------
    def materialize(self, tokens: Sequence[int] | str) -> KVState:
        """Prefill ``tokens`` once (reusing any cached prefix) and hold their K/V."""
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.runner.vocab_size, allow_empty=False)
        state, _, _ = self._prefill(tokens, "materialize", ())
        return state

    def fork(self, state: KVState, k: int) -> list[KVState]:
        """k children sharing every block of ``state``; no tensor is copied."""
        self._check(state)
        k = validation.fork_count("k", k)
        children = [state.derive("fork", (state.state_id,), branch=i, of=k) for i in range(k)]
        return [self._register(c) for c in children]

    def extend(self, state: KVState, tokens: Sequence[int]) -> KVState:
        """``state`` followed by ``tokens``: only the new tokens are prefilled."""
        self._check(state)
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.runner.vocab_size, allow_empty=False)
        new, _, _ = self._prefill(list(state.tokens) + tokens, "extend", (state,))
        return new

    def resume(
        self,
        state: KVState,
        suffix: Sequence[int] = (),
        max_new_tokens: int = 32,
        sampling: SamplingParams = GREEDY,
        stream: int = 0,
        return_logits: bool = False,
    ) -> Generation:
        """Prefill only ``suffix`` on top of ``state``, decode, and return a continuation state."""
        self._check(state)
        suffix = self.encode(suffix) if isinstance(suffix, str) else suffix
        suffix = validation.token_ids("suffix", suffix, self.runner.vocab_size)
        max_new_tokens = validation.max_new_tokens("max_new_tokens", max_new_tokens)
        validation.instance("sampling", sampling, SamplingParams)
        stream = validation.integer("stream", stream, minimum=0)
        compat.check_positions(state.length, len(suffix), max_new_tokens, self.runner.max_positions)
        tokens = list(state.tokens) + suffix
        new, out, reused = self._prefill(
            tokens,
            "resume",
            (state,),
            max_new_tokens,
            sampling=sampling,
            stream=stream,
            return_logits=return_logits,
        )
        out.metrics.tokens_reused = reused
        return Generation(
            out.generated, self.decode(out.generated), out.logits, out.metrics, new, new.own_blocks(state)
        )

    def resume_forks(
        self,
        state: KVState,
        suffixes: Sequence[Sequence[int] | str],
        max_new_tokens: int | Sequence[int] = 32,
        sampling: SamplingParams = GREEDY,
        streams: Sequence[int] | None = None,
        return_logits: bool = False,
        **batch_kw,
    ) -> ForkGenerations:
        """``resume(state, suffixes[i], stream=streams[i])`` for every i, as one batch.

        Same tokens as k separate resumes, over one copy of the prefix (``model/batched.py``).
        Returns one ``Generation`` per branch with its published continuation state, as a
        list whose ``stats`` attribute holds the batch's ``BatchStats``.
        """
        self._check(state)
        if isinstance(suffixes, str):
            raise InvalidInputError("suffixes must be a list of suffixes (token ids or text), got one string")
        suffixes = [validation.token_ids(f"suffixes[{i}]", self.encode(s) if isinstance(s, str) else s,
                                         self.runner.vocab_size) for i, s in enumerate(suffixes)]
        k = validation.fork_count("len(suffixes)", len(suffixes))
        per_branch = hasattr(max_new_tokens, "__iter__") and not isinstance(max_new_tokens, (str, bytes))
        limits = list(max_new_tokens) if per_branch else [max_new_tokens] * k
        if len(limits) != k:
            raise InvalidInputError(f"{k} suffixes but {len(limits)} token limits")
        limits = [validation.max_new_tokens(f"max_new_tokens[{i}]", m) for i, m in enumerate(limits)]
        validation.instance("sampling", sampling, SamplingParams)
        if streams is not None and len(streams) != k:
            raise InvalidInputError(f"{k} suffixes but {len(streams)} streams")
        for suf, m in zip(suffixes, limits):
            compat.check_positions(state.length, len(suf), m, self.runner.max_positions)
        # Decoding needs the last fed token's logits: a branch with no suffix re-feeds the
        # state's last token (as Engine.resume does), so then every branch shares one less token.
        prefix = state.length if all(suffixes) else state.length - 1
        feeds = [list(state.tokens[prefix:]) + suf for suf in suffixes]
        with self._lock:
            held = self.store.hold(b.key for b in state.blocks)
            blocks = [self.store.get(b.key) for b in state.blocks if b.start < prefix]
        try:
            out = self._resume_batch(state, prefix, feeds, blocks, limits, sampling, streams, return_logits, batch_kw)
        finally:
            with self._lock:
                self._drop(held)
        return out

    def _resume_batch(self, state, prefix, feeds, blocks, limits, sampling, streams, return_logits, batch_kw):
        k = len(feeds)
        if self.steps is None:
            batch = resume_batch(self.runner, blocks, prefix, feeds, limits, sampling, streams, return_logits, **batch_kw)
        else:  # one group in the step loop: the prefix held once, decoded with whatever else runs there
            start = self.runner.reusable(prefix)  # below fp32 each branch starts on a block boundary
            head = list(state.tokens[start:prefix])
            reqs = [StepRequest(blocks, start, head + feed, lim, sampling, stream, return_logits)
                    for feed, lim, stream in zip(feeds, limits, streams if streams is not None else range(k))]
            batch = BatchOutput(self.steps(reqs, True), None)
        kept = [b for b in state.blocks if b.end <= aligned_floor(prefix, self.block_size)]
        out = ForkGenerations()
        out.stats = batch.stats
        with self._lock:
            for feed, run in zip(feeds, batch):
                tokens = list(state.tokens[:prefix]) + feed + run.generated[:-1]
                new = self._publish(tokens, kept, run.new_blocks, "resume", (state,), tokens_reused=prefix,
                                    tokens_computed=len(feed), batched=k)
                self._states[new.state_id] = new
                out.append(Generation(run.generated, self.decode(run.generated), run.logits, run.metrics, new,
                                      new.own_blocks(state)))
        return out

    def merge(self, a: KVState, b: KVState, how: str = "auto") -> KVState:
        """Combine two states only in ways that stay exact.

        concat: ``b`` was computed on top of exactly ``a`` (contiguous positions, equal block
        chain, shared lineage) - the result is b's blocks, nothing recomputed.
        text: b's tokens past the common prefix are re-prefilled after ``a`` (a text-level
        reduction); exact because they now attend to a's tokens.
        auto: concat when provable, text otherwise. Different models/tokenizers always raise.
        """
        validation.choice("how", how, ("auto", "concat", "text"))
        self._check(a, "a")
        self._check(b, "b")
        validation.distinct_states("merge", a.state_id, b.state_id)
        compat.check_pair(a, b)
        if how in ("auto", "concat"):
            try:
                compat.check_concat(a, b)
                return self._register(b.derive("merge", (a.state_id, b.state_id), how="concat"))
            except MergeError:
                if how == "concat":
                    raise
        p = common_prefix_len(a.tokens, b.tokens)
        extra = list(b.tokens[p:])
        if not extra:
            raise MergeError(f"cannot merge {a.state_id} and {b.state_id}", ["b adds nothing after a"])
        state, _, _ = self._prefill(
            list(a.tokens) + extra, "merge", (a, b), detail={"how": "text", "reduced_tokens": len(extra)}
        )
        return state

    def release(self, state: KVState) -> int:
        """Drop ``state``; blocks no other live state holds are freed. Returns bytes freed."""
        validation.instance("state", state, KVState)
        with self._lock:
            freed = self.store.release(state)
            for key in freed:
                self.index.remove(key)
            self._states.pop(state.state_id, None)
        return sum(freed.values())

    def _register(self, state: KVState) -> KVState:
        self._states[state.state_id] = self.store.register(state)
        return state

    # -- baseline -----------------------------------------------------------------------
    def generate_text(
        self,
        tokens: Sequence[int] | str,
        max_new_tokens: int = 32,
        sampling: SamplingParams = GREEDY,
        stream: int = 0,
        return_logits: bool = False,
    ) -> Generation:
        """Text mode: prefill the whole prompt from nothing, as if no state existed."""
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        tokens = validation.token_ids("tokens", tokens, self.runner.vocab_size, allow_empty=False)
        max_new_tokens = validation.max_new_tokens("max_new_tokens", max_new_tokens)
        validation.instance("sampling", sampling, SamplingParams)
        stream = validation.integer("stream", stream, minimum=0)
        compat.check_positions(0, len(tokens), max_new_tokens, self.runner.max_positions)
        out = self.runner.run(
            [], 0, tokens, max_new_tokens, sampling=sampling, stream=stream, return_logits=return_logits, export=False
        )
        return Generation(out.generated, self.decode(out.generated), out.logits, out.metrics)

