"""The RPCs a KVRuntime calls (``client.scheduler.kv_*``), each scoped to the caller's tenant.

A client first answers a challenge (``kv_challenge``, its nonce sent back on the client's
own stream, ``kv_login``; see ``tenants``) and passes the session token it gets on every
call; the session is bound to that client (the keys a call acquires are wanted for it,
whatever a caller names). What a session sees and changes:

* lookup and acquire: only its namespace's blocks, and only while the task Dask holds
  under the key is one its namespace submitted (``kv_ownership``). A lookup takes the
  caller's own chain keys and tokens and answers with a count and block keys - never
  another block's token ids, so a cached prompt cannot be read back through it;
* register states: a state id once, by its namespace; a state lists only its namespace's
  blocks; the wait for their tasks is the server's, not the caller's;
* catalog rows, lifecycle events and cost-model decisions: its namespace's (admin: all);
* release: only its own states;
* the global budget, the memory weight and forced eviction: admin only, since they change
  what every tenant keeps.

``ClientHandlers`` holds the parts of the plugin these calls read and change; the plugin
installs ``handlers()`` on the scheduler.
"""

from __future__ import annotations

import asyncio
import time

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import is_block, short_key, tag_of
from daskflow_kv.state.catalog import KVCatalog

from .kv_budget import BudgetEnforcer
from .kv_events import EventLog
from .kv_leases import LeaseBook, held
from .kv_lifecycle import BlockLifecycle
from .kv_locality import Locality
from .kv_notes import MAX_BYTES, MAX_LIST, MAX_NUMBER, MAX_TEXT, MAX_TOKENS, real, shown
from .kv_ownership import KeyOwnership
from .kv_profiles import ProfileBook
from .kv_queue import QueueTracker
from .kv_settings import KVSettings
from .kv_timeline import KVTimeline
from .kv_usage import KVUsage
from .kv_views import KVViews
from .tenants import AccessDenied, Session, TenantRegistry

MAX_LIVE_STATES = 1 << 14  # live states one namespace may hold registered (each names its blocks)
MAX_LIVE_BLOCK_REFS = 1 << 18  # block keys its live states list together (16M tokens in 64-token blocks)
MAX_TOKEN_ID = 1 << 31  # a token id (any vocabulary is smaller)
MAX_BLOCK_SIZE = 1 << 16  # tokens per block
MAX_BANDWIDTH = 1e15  # bytes/s a probe may report (1 PB/s)
MAX_LATENCY = 3600.0  # s per fetch a probe may report

RPC_NAMES = ("kv_challenge", "kv_login", "kv_lookup", "kv_acquire", "kv_snapshot", "kv_register_states",
             "kv_release_states", "kv_catalog", "kv_counters", "kv_record_bandwidth", "kv_configure", "kv_evict_now",
             "kv_drop", "kv_workflow_done", "kv_run_done")


class Arrivals:
    """Wakes calls waiting for tasks the scheduler does not know yet: a client submits them on
    its stream and calls over RPC, which can overtake them."""

    __slots__ = ("_event",)

    def __init__(self):
        self._event = asyncio.Event()  # set (and replaced) whenever a graph arrives

    def note(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, present, timeout: float) -> bool:
        """Until ``present()`` holds (checked at each arrival) or ``timeout`` s pass. -> ``present()``."""
        deadline = time.monotonic() + timeout
        while not present():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True


def _strings(name: str, value, most: int = MAX_LIST) -> list[str]:
    if (not isinstance(value, (list, tuple)) or len(value) > most
            or not all(isinstance(v, str) and len(v) <= MAX_TEXT for v in value)):
        raise ValueError(f"{name} must be a list of at most {most} strings of at most {MAX_TEXT} characters")
    return list(value)


def _ints(name: str, value, lo: int, hi: int, most: int = MAX_LIST) -> list[int]:
    """A list of integers in [lo, hi] (no bools), or ValueError: bounded where it enters."""
    if (not isinstance(value, (list, tuple)) or len(value) > most
            or not all(type(v) is int and lo <= v <= hi for v in value)):
        raise ValueError(f"{name} must be a list of at most {most} integers in [{lo}, {hi}]")
    return list(value)


class ClientHandlers:
    __slots__ = ("_scheduler", "_settings", "_tenants", "_catalog", "_ownership", "_leases", "_locality", "_budget",
                 "_usage", "_queue", "_profiles", "_lifecycle", "_events", "_views", "_timeline", "arrivals")

    def __init__(self, scheduler, settings: KVSettings, tenants: TenantRegistry, catalog: KVCatalog,
                 ownership: KeyOwnership, leases: LeaseBook, locality: Locality, budget: BudgetEnforcer,
                 usage: KVUsage, queue: QueueTracker, profiles: ProfileBook, lifecycle: BlockLifecycle,
                 events: EventLog, views: KVViews, timeline: KVTimeline):
        self._scheduler = scheduler  # tasks and workers the answers describe
        self._settings = settings  # the budget and memory weight (the admin changes them)
        self._tenants = tenants  # sessions: who is calling, what they may see
        self._catalog = catalog  # prefix lookups, states
        self._ownership = ownership  # which namespace's task computes each KV key
        self._leases = leases  # acquisition of looked-up blocks
        self._locality = locality  # where a block is or will be
        self._budget = budget  # told of releases; forced checks
        self._usage = usage  # KV bytes per worker
        self._queue = queue  # busy seconds per worker
        self._profiles = profiles  # prefill profiles, links, probes
        self._lifecycle = lifecycle  # dropping the whole cache
        self._events = events  # lifecycle events of the calls
        self._views = views  # catalog rows and counters
        self._timeline = timeline  # finished workflows, for the KV page's live plots
        self.arrivals = Arrivals()  # graphs arriving (the plugin notes each): register_states waits on it

    def handlers(self) -> dict:
        """RPC name -> handler, for ``Scheduler.handlers``."""
        return {name: getattr(self, "handle_" + name.removeprefix("kv_")) for name in RPC_NAMES}

    def _session(self, session: str | None) -> Session:
        return self._tenants.session(session)

    async def _admin(self, session: str | None, confirm: str | None, what: str) -> Session:
        """The caller's admin session, confirmed on its own stream (``tenants.admin``)."""
        return await self._tenants.admin(session, confirm, what)

    # -- identity ---------------------------------------------------------------------------------
    def handle_challenge(self) -> str:
        return self._tenants.challenge()

    async def handle_login(self, namespace: str = "", nonce: str | None = None, proof: str | None = None) -> dict:
        """A session for the client whose stream sent ``nonce`` back (``BIND_OP``)."""
        s = await self._tenants.login_client(namespace, nonce, proof)
        return {"session": s.token, "namespace": s.namespace, "role": s.role, "open": self._tenants.open}

    def _own(self, key, s: Session) -> bool:
        """``key`` is a block of the caller's namespace (the admin's: any namespace's), and the
        task Dask holds under it is one that namespace submitted."""
        ns = self._catalog.namespace_of(key)
        return ns is not None and s.sees(ns) and self._ownership.computed_by(key, ns)

    # -- reuse --------------------------------------------------------------------------------------
    def handle_lookup(self, session: str, root: str, keys: list[str], tokens: list[int], block_size: int,
                      flow: str | None = None, view: bool | str = False) -> dict:
        """Longest cached prefix of the caller's request, acquired for its client before this returns.

        ``keys``: the request's own chain keys (full blocks), ``tokens``: its tokens (for a
        cached block that continues them only in part). Answers with how many leading tokens
        are covered and the blocks to read: keys, spans, sizes, where they are. ``view``: the
        answer carries the planner's snapshot too (``snapshot``, as ``kv_snapshot`` answers):
        a plan reads both, and one round trip is half the scheduler's messages of two;
        ``"uncovered"``: only when the blocks do not cover every token (a prefill follows,
        planned on it; a request all cached needs no plan, nor the snapshot's cost).
        """
        s = self._session(session)
        if not (type(view) is bool or view == "uncovered"):
            raise ValueError(f"view must be True, False or 'uncovered', got {shown(view)}")
        keys = _strings("keys", keys)
        tokens = _ints("tokens", tokens, 0, MAX_TOKEN_ID - 1, most=MAX_TOKENS)
        if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {shown(block_size)}")
        if not isinstance(root, str) or len(root) > MAX_TEXT:
            raise ValueError(f"root must be a string of at most {MAX_TEXT} characters")
        match = self._catalog.lookup(root, keys, tokens, block_size, None if s.is_admin else s.namespace)
        usable_blocks = []
        for b in match.blocks:  # stop at the first block Dask does not hold, or not its namespace's
            if not held(self._scheduler.tasks.get(b.key)) or not self._own(b.key, s):
                break
            usable_blocks.append(b)
        covered = (match.tokens if len(usable_blocks) == len(match.blocks)
                   else (usable_blocks[-1].end if usable_blocks else 0))
        states = self._leases.acquire([b.key for b in usable_blocks], s.client, _run(s, flow))
        blocks = []
        for b in usable_blocks:
            ts = self._scheduler.tasks[b.key]
            blocks.append({
                "key": b.key,
                "start": b.start,
                "end": b.end,
                "nbytes": b.nbytes,
                "who_has": sorted(ws.address for ws in (ts.who_has or ())),
                "where": self._locality.where(ts),
                "state": states.get(b.key, ts.state),
            })
        answer = {"tokens": covered, "blocks": blocks}
        if view is True or (view == "uncovered" and covered < len(tokens)):
            answer["snapshot"] = self._snapshot(s)
        return answer

    def handle_acquire(self, session: str, keys: list[str], flow: str | None = None) -> dict[str, str]:
        """Take a reference to the blocks of content addresses the caller computed (its own
        namespace only). ``flow``: the workflow run that will hold them (see ``kv_budget``).

        -> content address: the Dask key acquired for it, or "" where the scheduler keeps that
        content only under a key it does not hold (released lineage, or erred): the caller makes
        it under a fresh key (``keys.rebuilt_key``). Addresses the scheduler does not know are
        left out: their own key is free.
        """
        s = self._session(session)
        tag = None if s.is_admin else s.tag
        current, stale = {}, {}
        for content in _strings("keys", keys):
            if tag is not None and tag_of(content) != tag:
                continue  # not the caller's to ask about
            key = self._catalog.current_key(content)
            if held(self._scheduler.tasks.get(key)) and self._own(key, s):
                current[content] = key
            elif key in self._scheduler.tasks or content in self._scheduler.tasks:  # its key is taken
                stale[content] = ""
        self._leases.acquire(list(current.values()), s.client, _run(s, flow))  # held: all taken
        return {**stale, **current}

    def handle_snapshot(self, session: str) -> dict:
        """What the planner needs: workers and their load, links, prefill profiles. No user data.

        ``links``: ``[src, dst, bytes_per_s, latency_s or None]`` per pair with a bandwidth;
        ``bandwidth`` / ``latency`` say the same keyed by "src->dst" (older clients read those).
        """
        return self._snapshot(self._session(session))

    def _snapshot(self, s: Session) -> dict:
        sch = self._scheduler
        kv_bytes = self._usage.bytes_by_worker()
        return {
            "workers": {
                addr: {"nthreads": ws.nthreads, "processing": len(ws.processing), "kv_bytes": kv_bytes[addr],
                       "busy_s": self._queue.busy_seconds(addr)}
                for addr, ws in sch.workers.items()
            },
            "links": self._profiles.links(s.namespace),
            "bandwidth": self._profiles.bandwidth(s.namespace),
            "latency": self._profiles.latency(s.namespace),
            "default_bandwidth": sch.bandwidth,
            "prefill_profiles": self._profiles.prefill_profiles(),
            "kv_budget_bytes": self._settings.kv_budget_bytes,
            "memory_weight": self._settings.memory_weight,
        }

    async def handle_register_states(self, session: str, metas: list[dict]) -> None:
        """Record the caller's states, once the scheduler knows all their blocks.

        The client submits block tasks over its batched stream and calls this over RPC,
        which can overtake them; waiting here (at most ``register-wait``, woken as graphs
        arrive) means that once an operation returns, every later lookup (from any client of
        the namespace) sees its blocks. A state id is registered once, by one namespace; a
        state lists only its own namespace's blocks.
        """
        s = self._session(session)
        if not isinstance(metas, (list, tuple)) or len(metas) > MAX_LIST:
            raise ValueError(f"metas must be a list of at most {MAX_LIST} states")
        metas = [self._state_meta(m, s) for m in metas]
        if len({m["state_id"] for m in metas}) < len(metas):
            raise ValueError("a state id appears twice in one registration")
        self._room_for_states(s, metas)
        keys = {k for m in metas for k in m["block_keys"]}
        await self.arrivals.wait_for(lambda: keys <= self._scheduler.tasks.keys(), self._settings.register_wait)
        if s.client not in self._scheduler.clients:
            # It left while this waited: remove_client has released its states already, and one
            # added now would stay live for good (seen once under load, tests/test_client_lost.py).
            return
        foreign = [k for k in keys if self._catalog.namespace_of(k) not in (None, s.namespace)]
        if foreign:
            raise AccessDenied(f"block {short_key(foreign[0])} is another namespace's: a state lists only its "
                               "own namespace's blocks")
        for meta in metas:
            if meta["state_id"] in self._catalog.states:  # registered meanwhile
                raise AccessDenied(f"state {meta['state_id']} is already registered")
            self._catalog.add_state(meta, s.namespace, s.client)
            self._events.record(meta.get("op", "state"), s.namespace, state_id=meta["state_id"],
                                parents=list(meta.get("parents", ())), blocks=len(meta["block_keys"]),
                                tokens=meta.get("tokens", 0), worker=meta.get("worker"),
                                **{k: meta[k] for k in ("tokens_reused", "tokens_computed") if k in meta})

    def _room_for_states(self, s: Session, metas: list[dict]) -> None:
        """One namespace's live states are bounded (``MAX_LIVE_STATES``, ``MAX_LIVE_BLOCK_REFS``):
        a state lives until its client releases it or leaves, so without a bound one tenant
        could grow the scheduler's memory without limit (states listing no block, say)."""
        live = [st for st in self._catalog.states.values() if st.status == "live" and st.namespace == s.namespace]
        states = len(live) + len(metas)
        refs = sum(len(st.block_keys) for st in live) + sum(len(m["block_keys"]) for m in metas)
        if states > MAX_LIVE_STATES or refs > MAX_LIVE_BLOCK_REFS:
            raise ValueError(f"namespace {s.namespace!r} would hold {states} live states listing {refs} blocks, more "
                             f"than {MAX_LIVE_STATES} states or {MAX_LIVE_BLOCK_REFS} blocks: release some first")

    def _state_meta(self, meta, s: Session) -> dict:
        """One state's registration, checked: its id new, its blocks the caller's namespace's."""
        if not isinstance(meta, dict) or not isinstance(meta.get("state_id"), str) or len(meta["state_id"]) > MAX_TEXT:
            raise ValueError("each state needs a state_id string")
        sid = meta["state_id"]
        st = self._catalog.states.get(sid)
        if st is not None:
            raise AccessDenied(f"state {sid} is already registered" + ("" if st.namespace == s.namespace
                                                                         else " by another namespace"))
        keys = _strings("block_keys", meta.get("block_keys"))
        mine = s.tag
        bad = [k for k in keys if not is_block(k) or tag_of(k) != mine]
        if bad:
            raise AccessDenied(f"state {sid} lists block {short_key(bad[0])}, not a block of namespace "
                               f"{s.namespace!r}: a state lists only its own namespace's blocks")
        for name in ("tokens", "tokens_reused", "tokens_computed"):
            v = meta.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 31:
                raise ValueError(f"state {sid}: {name} must be a non-negative integer")
        for name in ("op", "worker", "flow"):
            if meta.get(name) is not None and (not isinstance(meta[name], str) or len(meta[name]) > MAX_TEXT):
                raise ValueError(f"state {sid}: {name} must be a short string")
        return {**meta, "block_keys": keys, "parents": _strings("parents", meta.get("parents", []))}

    async def handle_release_states(self, session: str, state_ids: list[str], reuse_expected: bool = False,
                                    metas: list[dict] | None = None) -> None:
        """Release the caller's states, in one call (a level's branches and continuations: one
        RPC, not one each). ``reuse_expected``: a later step of the caller's workflow reads
        their blocks again (evicted last for ``scheduler.reuse-hint``). One state that is not
        the caller's refuses the whole call, before anything is registered or released.

        ``metas``: states to register first, as ``kv_register_states`` does (every check of its,
        all or none): the forks a client made since its last call ride on the release that
        follows them (a fork, then its parent's release: one round trip, not two)."""
        s = self._session(session)
        ids = _strings("state_ids", state_ids)
        self._own_states(s, ids)
        if metas is not None:
            await self.handle_register_states(session, metas)
        states = self._own_states(s, ids)  # those just registered too
        for st in states:
            if reuse_expected is True:
                self._leases.plan([k for k in st.block_keys if k in self._catalog.blocks], time.time())
            self._catalog.release_state(st.state_id)
            self._events.record("release", st.namespace, state_id=st.state_id)
        if states:
            self._budget.note_change()
            self._budget.note_progress()

    def _own_states(self, s: Session, ids: list[str]) -> list:
        """The registered states of ``ids``, or AccessDenied if any is another namespace's."""
        states = [st for st in map(self._catalog.states.get, ids) if st is not None]
        for st in states:
            if not s.sees(st.namespace):
                raise AccessDenied(f"state {st.state_id} is not one of namespace {s.namespace!r}'s")
        return states

    # -- views ----------------------------------------------------------------------------------
    def handle_catalog(self, session: str) -> list[dict]:
        s = self._session(session)
        return self._views.catalog_rows(None if s.is_admin else s.namespace)

    def handle_counters(self, session: str) -> dict:
        s = self._session(session)
        return self._views.counters_view(None if s.is_admin else s.namespace, public=True)

    def handle_workflow_done(self, session: str, agents: int, ttft_s: list[float]) -> None:
        """A runtime finished a workflow of ``agents`` agents: each one's TTFT (seconds), for the
        KV page's live plots - of the caller's namespace when tenants are configured (an open
        cluster is one trust domain, and its namespaces are whatever callers say)."""
        s = self._session(session)
        self._timeline.workflow_done(time.time(), None if self._tenants.open else s.namespace, agents, ttft_s)

    def handle_run_done(self, session: str, flow: str) -> None:
        """A workflow run of the caller's ended (finished or failed): it holds nothing any more,
        and its name's place in line is forgotten."""
        s = self._session(session)
        run = _run(s, flow)
        self._leases.forget_run(run)
        self._budget.forget_run(run)

    def handle_record_bandwidth(self, session: str, src: str, dst: str, bandwidth: float,
                                latency: float | None = None) -> None:
        """A calibration probe's figures, used for this namespace's plans (others keep theirs)."""
        s = self._session(session)
        for name, v, hi, optional in (("bandwidth", bandwidth, MAX_BANDWIDTH, False),
                                      ("latency", latency, MAX_LATENCY, True)):
            if (v is None and not optional) or (v is not None and not (real(v, 0, hi) and v > 0)):
                raise ValueError(f"{name} must be a positive number of at most {hi:g}, got {shown(v)}")
        workers = self._scheduler.workers
        if not (isinstance(src, str) and isinstance(dst, str) and src != dst and src in workers and dst in workers):
            # a pair of live workers only: any pair at all would grow the scheduler's memory without limit
            raise ValueError("src and dst must be the addresses of two workers of this cluster")
        self._profiles.record_probe(s.namespace, src, dst, bandwidth, latency)

    # -- knobs that affect everyone ---------------------------------------------------------------
    async def handle_configure(self, session: str, kv_budget_bytes=None, memory_weight=None, unset_budget=False,
                               confirm: str | None = None) -> None:
        await self._admin(session, confirm, "the KV budget and memory weight")
        if kv_budget_bytes is not None and (type(kv_budget_bytes) is not int or not 0 <= kv_budget_bytes <= MAX_BYTES):
            raise ValueError(f"kv_budget_bytes must be an integer in [0, {MAX_BYTES}], got {shown(kv_budget_bytes)}")
        if memory_weight is not None and not real(memory_weight, 0, MAX_NUMBER):
            raise ValueError(f"memory_weight must be a number in [0, {MAX_NUMBER:g}], got {shown(memory_weight)}")
        if kv_budget_bytes is not None or unset_budget:
            self._settings.kv_budget_bytes = kv_budget_bytes
        if memory_weight is not None:
            self._settings.memory_weight = memory_weight
        self._budget.enforce(force=True)  # a lower budget applies now, not at the next tick

    async def handle_evict_now(self, session: str, confirm: str | None = None) -> list[str]:
        await self._admin(session, confirm, "forced eviction")
        return self._budget.enforce(force=True)

    async def handle_drop(self, session: str, confirm: str | None = None) -> int:
        """Before a cluster closes: the cache lets go of every block, and the caller's client of every key.

        Workers then leave holding nothing, instead of Dask reporting each cached block as
        lost. Admin only: it empties every tenant's cache. Returns how many blocks went.
        """
        s = await self._admin(session, confirm, "dropping the whole KV cache")
        stimulus = f"kv-drop-{time.time()}"
        dropped = self._lifecycle.drop_cache(stimulus)
        cs = self._scheduler.clients.get(s.client)
        if cs is not None:
            di.unwant(self._scheduler, [ts.key for ts in cs.wants_what], s.client, stimulus)
        self._events.record("drop", None, blocks=dropped, by=s.namespace)
        return dropped


def _run(s, flow) -> tuple | None:
    """The (namespace, workflow run) a caller says it works for; runs are per namespace."""
    if flow is None:
        return None
    if not isinstance(flow, str) or len(flow) > MAX_TEXT:
        raise ValueError(f"flow must be a string of at most {MAX_TEXT} characters")
    return (s.namespace, flow)
