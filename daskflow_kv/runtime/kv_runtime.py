"""KV states as Dask futures: materialize, fork, resume, extend, merge across workers.

``KVRuntime`` is the distributed counterpart of ``Engine``, a façade: it checks every
argument (bad input fails before any RPC or task) and hands the work to its parts, each a
module with its own declared state - the plugin's RPCs (``plugin_client``), prefix lookups
held as futures (``prefix_cache``), placement with measurements (``planner``), annotated
tasks (``submit``), new blocks and states (``publish``, ``registry``), the materialize and
resume steps (``materialize``, ``resume``), the persistent tier (``kv_persistence``),
probes (``calibration``) and the text codec. Blocks are Dask keys (content addresses) held
in worker memory; a ``DistKVState`` is a descriptor plus the futures that keep them alive.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from distributed import Client, Future, wait

from .. import config, validation
from ..errors import StateReleasedError
from ..model.sampling import GREEDY, SamplingParams
from ..model.text_codec import TextCodec
from ..policy.cost_model import explain
from ..policy.placement import POLICIES
from ..policy.workflow_gate import valid_per_worker
from ..state import compat
from ..state.blocks import keyed_digest
from ..transport import serialization  # noqa: F401  -- this client reads tensors (logits) too
from . import html_repr, parallel_materialize, tasks
from .calibration import Calibrator
from .delegate import Delegate
from .handles import DistGeneration, DistKVState
from ..store.tenant import StoreTenant
from .kv_persistence import PersistentTier, store_settings
from .materialize import Materializer
from .planner import Planner
from .plugin_client import PluginClient, gather
from .prefix_cache import PrefixCache
from .publish import Publisher
from .registry import StateRegistry
from .resume import Resumer
from .submit import Submitter

logger = logging.getLogger("daskflow_kv.runtime")


class KVRuntime:
    __slots__ = ("client", "spec", "plugin", "facts", "key_digest", "codec", "tier", "calibrator", "planner",
                 "submitter", "prefixes", "registry", "materializer", "resumer")
    client: Client  # the Dask client every task and RPC goes through
    spec: tasks.ModelSpec  # model, dtype, block size, namespace, device: what every task loads
    plugin: PluginClient  # the scheduler plugin's RPCs, as this runtime's session
    facts: tasks.ModelFacts  # the model as a worker loaded it: fingerprint, sizes, exactness limits
    key_digest: str  # seeds every block key: HMAC of the fingerprint with the namespace's secret
    codec: TextCodec  # text <-> token ids, as text mode does it
    tier: PersistentTier  # the persistent store (writes, measured loads, decisions)
    calibrator: Calibrator  # link, prefill and store probes
    planner: Planner  # views, placements, cost-model decisions, what-if overrides
    submitter: Submitter  # tasks with the plugin's annotations
    prefixes: PrefixCache  # lookups and acquires, as held futures
    registry: StateRegistry  # registers new states (fork and merge adopt futures through it)
    materializer: Materializer  # materialize / extend / merge by text
    resumer: Resumer  # resume_many

    def __init__(self, client: Client, model: str | None = None, dtype: str | None = None,
                 block_size: int | None = None, namespace: str | None = None, device: str = "cpu",
                 kv_budget_bytes: int | str | None = None, memory_weight: float | None = None,
                 secret: str | None = None, kv_store: str | None = None, kv_store_write: str | None = None):
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
        namespace = config.get("namespace", namespace)
        store, store_write = store_settings(kv_store, kv_store_write, StoreTenant.from_config(namespace, secret))
        self.client = client
        self.spec = tasks.ModelSpec(model, dtype, block_size, namespace, device)
        # Idempotent: a plugin already there (preload, another runtime) stays, with its catalog.
        # It installs the worker plugins and the KV page itself (plugins/kv_scheduler.py).
        client.register_plugin(KVSchedulerPlugin())
        self.plugin = PluginClient.login(client, self.spec.namespace, secret)
        if kv_budget_bytes is not None or memory_weight is not None:  # explicit arguments win over config
            self.configure(kv_budget_bytes=config.get_bytes("kv-budget", kv_budget_bytes), memory_weight=memory_weight)
        [self.facts] = gather(client, [client.submit(tasks.model_facts, self.spec, pure=False)])
        self.key_digest = keyed_digest(self.facts.fingerprint.digest, config.get("secret", secret))
        self.codec = TextCodec(load_tokenizer(model))
        # The parts, each given what it uses.
        fp, digest = self.facts.fingerprint, self.key_digest
        self.tier = PersistentTier(client, store, store_write, fp.digest, self.spec.namespace)
        self.calibrator = Calibrator(client, self.plugin, self.spec, self.facts, self.tier)
        self.planner = Planner(self.plugin, self.calibrator)
        self.submitter = Submitter(client, self.spec, self.facts.bytes_per_token, self.facts.vocab_size)
        self.prefixes = PrefixCache(client, self.plugin, digest, block_size)
        publisher = Publisher(self.prefixes, self.submitter, self.tier, digest, fp.digest, self.facts.bytes_per_token)
        self.registry = StateRegistry(self.plugin, fp, block_size, device, self)
        self.materializer = Materializer(self.prefixes, self.tier, self.planner, self.submitter, publisher,
                                         self.registry, self.facts)
        self.resumer = Resumer(self.prefixes, self.planner, self.submitter, publisher, self.registry, self.tier,
                               self.codec, self.facts)

    # -- what callers read, kept by the parts; the what-if overrides are set here too -------------
    session = Delegate("plugin.session")  # this runtime's login: token, namespace, role
    fingerprint = Delegate("facts.fingerprint")  # the model's, on every state
    block_size = Delegate("spec.block_size")  # tokens per block
    tokenizer = Delegate("codec.tokenizer")  # the model's tokenizer
    decisions = Delegate("planner.decisions")  # cost-model decisions, oldest first
    bandwidth_override = Delegate("planner.bandwidth_override", settable=True)  # bytes/s for every pair (what-if)
    prefill_override = Delegate("planner.prefill_override", settable=True)  # one PrefillProfile for every worker
    parallel_plans = Delegate("materializer.parallel.plans")  # parallel-prefill choices, oldest first
    store = Delegate("tier.store")  # the persistent store (None without one)
    store_write = Delegate("tier.store_write")  # all | materialize-only | off
    store_samples = Delegate("tier.samples")  # store load timings measured on workers
    store_decisions = Delegate("tier.decisions")  # store load-or-prefill decisions, oldest first
    # -- methods that are a part's own ----------------------------------------------------------------
    encode = Delegate("codec.encode")  # text -> token ids, no special tokens (as text mode)
    decode = Delegate("codec.decode")  # token ids -> text, special tokens skipped
    view = Delegate("planner.view")  # -> ClusterView: what the planner sees now
    counters = Delegate("plugin.counters")  # the plugin's counters for this namespace
    calibrate = Delegate("calibrator.calibrate")  # (probe_bytes, probe_tokens, probe_repeats): links, prefill, store
    flush_store = Delegate("tier.flush")  # (timeout): wait for queued store writes; -> how many still pend
    calibrate_store = Delegate("tier.calibrate")  # (probe_bytes): one probe object written and read back
    store_profile = Delegate("tier.profile")  # -> StoreProfile measured on workers, None before any
    explain_store = Delegate("tier.explain")  # the store decisions, one line each

    def configure(self, kv_budget_bytes: int | None = None, memory_weight: float | None = None, unset_budget=False):
        kv_budget_bytes = validation.optional("kv_budget_bytes", kv_budget_bytes, validation.byte_size, minimum=0)
        memory_weight = validation.optional("memory_weight", memory_weight, validation.number, minimum=0)
        self.plugin.configure(kv_budget_bytes, memory_weight, unset_budget)

    def set_workflow_gate(self, per_worker: float | None) -> dict:
        """Admin: at most ``per_worker`` running workflow runs per worker (None: no limit), the
        rest waiting in line (``daskflow-kv.scheduler.workflow-gate``). -> the gate now."""
        return self.plugin.gate_configure(valid_per_worker(per_worker))

    def _check(self, state: DistKVState, name: str = "state") -> None:
        validation.instance(name, state, DistKVState)
        if state.released:
            raise StateReleasedError(f"state {state.state_id} was released; materialize it again")
        compat.check_state_for_model(state.state, self.fingerprint, self.block_size)

    def _tokens(self, name: str, tokens: Sequence[int] | str) -> list[int]:
        tokens = self.encode(tokens) if isinstance(tokens, str) else tokens
        return validation.token_ids(name, tokens, self.facts.vocab_size, allow_empty=False)

    # -- operators ------------------------------------------------------------------------
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
        tokens = self._tokens("tokens", tokens)
        parallel = parallel_materialize.width(parallel)
        if worker is not None and parallel == "auto":
            parallel = 1  # a caller who names the worker asked for that worker
        return self.materializer.run(tokens, "materialize", (), worker, parallel)

    def fork(self, state: DistKVState, k: int) -> list[DistKVState]:
        """k children sharing the parent's block futures; no task, no copy."""
        self._check(state)
        k = validation.fork_count("k", k)
        return self.registry.adopt([state.state.derive("fork", (state.state_id,), branch=i, of=k) for i in range(k)],
                                   state.futures)

    def extend(self, state: DistKVState, tokens: Sequence[int]) -> DistKVState:
        self._check(state)
        return self.materializer.run(list(state.tokens) + self._tokens("tokens", tokens), "extend", (state,))

    def resume(self, state: DistKVState, suffix: Sequence[int] = (), max_new_tokens: int = 32, **kw) -> DistGeneration:
        return self.resume_many([(state, suffix)], max_new_tokens, **kw)[0]

    def resume_many(self, requests: Sequence[tuple[DistKVState, Sequence[int]]], max_new_tokens: int = 32,
                    sampling: SamplingParams = GREEDY, policy: str = "auto", workers: Sequence[str] | None = None,
                    return_logits: bool = False, batch: bool = True) -> list[DistGeneration]:
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
        return self.resumer.run([s for s, _ in requests], prompts, max_new_tokens, sampling, policy, workers,
                                return_logits, batch)

    def merge(self, a: DistKVState, b: DistKVState, how: str = "auto") -> DistKVState:
        """Exact combinations only; see Engine.merge for the rules."""
        validation.choice("how", how, ("auto", "concat", "text"))
        self._check(a, "a")
        self._check(b, "b")
        validation.distinct_states("merge", a.state_id, b.state_id)
        compat.check_pair(a.state, b.state)
        return self.materializer.merge(a, b, how)

    def release(self, state: DistKVState, reuse_expected: bool = False) -> None:
        """Drop this handle's references; cached blocks stay until evicted under the budget.
        ``reuse_expected``: a later step will look this context up again - its blocks are
        evicted last (``scheduler.reuse-hint``), a hint the budget may still override."""
        self.release_many([state], reuse_expected)

    def release_many(self, states: Sequence[DistKVState], reuse_expected: bool = False) -> None:
        """``release`` for several states in one scheduler call (the scheduler's CPU per
        workflow is what caps a cluster: docs/simulation.md, "Where one scheduler stops")."""
        for state in states:
            validation.instance("state", state, DistKVState)
        fresh = [st for st in dict.fromkeys(states) if not st.released]
        for state in fresh:
            state.released = True
            state.futures = ()  # forks share the tuple: the blocks go only when no handle holds it
        if fresh:
            self.plugin.release_states([st.state_id for st in fresh], bool(reuse_expected))

    # -- baseline and introspection ---------------------------------------------------------
    def generate_text(self, tokens: Sequence[int] | str, max_new_tokens: int = 32, sampling: SamplingParams = GREEDY,
                      stream: int = 0, worker: str | None = None, return_logits: bool = False) -> Future:
        """Text mode on a worker: the whole prompt prefilled from nothing. A future of GenerationResult."""
        tokens = self._tokens("tokens", tokens)
        max_new_tokens = validation.max_new_tokens("max_new_tokens", max_new_tokens)
        validation.instance("sampling", sampling, SamplingParams)
        stream = validation.integer("stream", stream, minimum=0)
        compat.check_positions(0, len(tokens), max_new_tokens, self.facts.max_positions)
        return self.client.submit(tasks.text_generate, self.spec, tokens, max_new_tokens, sampling, stream,
                                  return_logits, workers=[worker] if worker else None, pure=False)

    def catalog(self):
        """The plugin's catalog as a pyarrow Table, one row per (state, block)."""
        from ..state.catalog import rows_to_arrow

        return rows_to_arrow(self.plugin.catalog())

    def explain(self) -> str:
        # Copied first (in one step, under the GIL): workflows on other threads of this runtime
        # keep appending, and a deque iterated while it grows raises.
        lines = [explain(d) for d in list(self.decisions)]
        lines += [f"parallel prefill over {p.width}: {p.reason}" for p in list(self.parallel_plans)]
        return "\n".join(lines + ([self.explain_store()] if self.store_decisions else []))

    def note_workflow(self, agents: int, ttft_s: Sequence[float]) -> None:
        """Tell the scheduler a workflow of ``agents`` agents finished, with each one's TTFT (the
        KV page's live plots of this namespace). Informational: a refusal or a lost scheduler is
        logged, never the workflow's failure."""
        try:
            self.plugin.workflow_done(agents, [max(0.0, t) for t in ttft_s])
        except Exception as e:  # noqa: BLE001
            logger.debug("daskflow-kv: workflow report not recorded: %s", e)

    def end_run(self, run: str) -> None:
        """Tell the scheduler workflow run ``run`` ended (finished or failed), after its
        releases: under a budget it no longer holds anything. Never fails the caller."""
        try:
            self.plugin.run_done(run)
        except Exception as e:  # noqa: BLE001
            logger.debug("daskflow-kv: end of run %s not recorded: %s", run, e)

    def wait(self, states: Sequence[DistKVState], timeout=None) -> None:
        wait([f for s in states for f in s.futures], timeout=timeout)

    def _repr_html_(self) -> str:  # a notebook shows the model, workers, KV against the budget, links
        return html_repr.runtime_html(self)
