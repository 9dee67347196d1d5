"""The KV of a conversation while its tool runs: kept, spilled or dropped, then prefetched.

When a step's agent waits on a tool call (its next turn ``follows`` it and reads the
call), the run's ``KVWait`` prices the three choices with ``policy.kv_wait.decide_wait``
from what it measured - the tool's durations (``tool_calls.HISTORY``), the store's read
speed, the holding worker's prefill profile, KV bytes and budget - and acts:

keep   the continuation state stays in the run's held states (pinned);
spill  its blocks are written to the store (``PersistentTier.write_state``) and released;
       ``prefetch_after`` seconds into the call it is materialized again on a thread of its
       own (a memory hit if the budget left it, else read back from the store) and held for
       the next turn;
drop   it is released: the next turn's lookup finds what the budget left, and prefills
       the rest.

Either way the next turn's prompt is built from text and resumed from the longest cached
prefix, so the choice moves time, never tokens. Each decision is a line of the run's
``explain`` (``CompiledWorkflow.taken``) and a record in ``decisions``.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field

from ..policy.kv_wait import WaitDecision, WaitFacts, decide_wait, explain_wait
from .spec import Tool
from .tool_calls import HISTORY, history_key

logger = logging.getLogger("daskflow_kv.flow")


@dataclass(slots=True)
class Prefetch:
    due: float  # time.time() to read the state back
    conversation: str  # the agent whose state it is
    tokens: tuple[int, ...]  # the state's tokens
    tool: str  # the call it waits on


@dataclass(slots=True, eq=False)
class KVWait:
    rt: object  # the KVRuntime the run uses
    forced: str | None = None  # keep | spill | drop for every call (a benchmark's arm); None: the policy
    decisions: list[dict] = field(default_factory=list)  # one per call, in order
    _prefetch: list[Prefetch] = field(default_factory=list)  # reads not started yet
    _threads: list[threading.Thread] = field(default_factory=list)  # reads started
    _ready: list[tuple] = field(default_factory=list)  # (prefetch, state, time.time()) read, not collected
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, conversation: str, states: dict, tool: Tool, started_at: float, note) -> WaitDecision:
        """``states[conversation]`` waits on ``tool`` (submitted at ``started_at``): decide and act."""
        state = states[conversation]
        d = decide_wait(self.wait_facts(state, tool), self.forced)
        if d.action in ("spill", "drop"):
            if d.action == "spill":
                self.rt.tier.write_state(state)
                self._prefetch.append(Prefetch(started_at + d.prefetch_after, conversation, state.tokens, tool.name))
            del states[conversation]
            self.rt.release(state)
        self.decisions.append({"conversation": conversation, "tool": tool.name, "at": started_at, **d.as_dict()})
        note(f"{conversation} waits on {tool.name}: {explain_wait(d)}")
        return d

    def wait_facts(self, state, tool: Tool) -> WaitFacts:
        view = self.rt.view()
        worker = state.state.worker
        if worker is None and state.futures:  # made without a prefill (all cached): where its last block is
            held = list(self.rt.client.who_has([state.futures[-1]]).values())
            worker = next(iter(held[0]), None) if held and held[0] else None
        load = view.workers.get(worker)
        store = None
        if self.rt.store is not None:
            store = self.rt.store_profile()
            if store is None:  # never measured: one probe, once per runtime
                self.rt.calibrate_store()
                store = self.rt.store_profile()
        return WaitFacts(state.nbytes, state.length, HISTORY.durations(history_key(tool)),
                         load.kv_bytes if load is not None else 0, view.kv_budget_bytes, view.profile(worker), store)

    def next_due(self) -> float | None:
        return min((p.due for p in self._prefetch), default=None)

    def tool_done(self, tool: str) -> None:
        """The call returned before its prefetch: the next turn's own lookup reads the state."""
        self._prefetch = [p for p in self._prefetch if p.tool != tool]

    def prefetch_due(self, now: float | None = None) -> None:
        """Start reading back the spilled states whose time has come, each on its own thread:
        a read waits for the budget's room like any task, and the run must not wait with it
        (its other branches go on). ``collect`` hands them to the run."""
        now = time.time() if now is None else now
        due = [p for p in self._prefetch if p.due <= now]
        self._prefetch = [p for p in self._prefetch if p.due > now]
        for p in due:
            th = threading.Thread(target=contextvars.copy_context().run, args=(self._read_back, p), daemon=True,
                                  name=f"kv-prefetch-{p.conversation}")
            self._threads.append(th)
            th.start()

    def _read_back(self, p: Prefetch) -> None:
        try:
            state = self.rt.materialize(list(p.tokens))
        except Exception as e:  # noqa: BLE001 -- a prefetch is a hint: the next turn looks it up anyway
            logger.debug("daskflow-kv: prefetch of %s failed: %s", p.conversation, e)
            return
        with self._lock:
            self._ready.append((p, state, time.time()))

    def collect(self, states: dict) -> None:
        """Hand the states read back so far to the run: each held until its next turn (one the
        run holds already, or whose turn has run, is let go)."""
        with self._lock:
            ready, self._ready = self._ready, []
        for p, state, at in ready:
            if p.conversation in states:
                self.rt.release(state)
            else:
                states[p.conversation] = state
            for rec in reversed(self.decisions):
                if rec["conversation"] == p.conversation and rec["tool"] == p.tool:
                    rec["prefetched_at"] = at
                    break

    def close(self, timeout: float = 30.0) -> None:
        """The run ended: wait for reads in flight and let go of what they bring back."""
        self._prefetch.clear()
        for th in self._threads:
            th.join(timeout)
        with self._lock:
            ready, self._ready = self._ready, []
        self.rt.release_many([state for _, state, _ in ready])
