"""Issue 55's decision check: for each tool call, keep / spill / drop all measured, and the
policy's choice scored against the best of the three.

A trial is one call: a conversation state of ``tokens`` tokens, a tool wait drawn from
[lo, hi] s, and a regime:

idle       no budget: nothing needs the room;
room       the budget (3x the state) is full: the state and an evictable filler twice its
           size; a competitor arrives during the wait and fits by evicting filler;
contended  as room, but the competitor needs more than the filler frees: the state's room
           too, or another worker's (the other worker has room: the budget moves the competitor
           there after its admission patience);
saturated  as contended, and the other worker's budget is full of KV its work holds: the
           competitor needs the state's room (what a loaded stream's workers look like).

Each action runs from the same start (caches drained, state and filler built again): the
action applied (``flow.kv_wait.KVWait``, forced), the competitor started 0.1 s into the
wait, the tool "returns" after the wait, and the next turn resumes with an observation
(one token). cost = the next turn's delay after the return (to its first token) + the
competitor's time from its start until its blocks exist: what the conversation and its
neighbour lost. The policy's choice is the real ``KVWait`` decision at the call (the
worker's KV and budget, the store's and the prefill's measured speed, the tool's measured
durations: earlier draws of the same distribution); it is right when its cost is within
``tolerance`` (s, or that fraction of the best) of the best action's. A next turn the budget
preempts is released and tried again after a back-off, as the executor does; one preempted
``RESUME_TRIES`` times is given up, its cost then a lower bound (the time until then).
"""

from __future__ import annotations

import random
import threading
import time

from ..errors import KVPreempted
from ..flow.kv_wait import KVWait
from ..flow.spec import Tool
from ..flow.tool_calls import HISTORY, history_key
from ..policy.kv_wait import WAIT_ACTIONS, decide_wait
from ..runtime.workflow_run import workflow_run
from . import systems as S

REGIMES = ("idle", "room", "saturated")  # "contended" (another worker has room) is not in the published set
RESUME_TRIES = 8  # a next turn the budget preempted to break a deadlock is released and tried again (as the executor
# does); after this many (~13 s of backing off) the arm gives up: its cost is then a lower bound
COMPETITOR_DELAY_S = 0.1


def _trial_tool(fn_name: str = "trial_tool") -> Tool:
    def trial_tool(arg: str) -> str:  # never called: it names the durations the trials keep
        return arg
    trial_tool.__name__ = fn_name
    return Tool("call", trial_tool)


def _tokens(rt, text: str, n: int) -> list[int]:
    ids = rt.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _arm(*args, **kwargs) -> dict:
    """``_arm_in_run`` as one workflow run (the conversation's; the competitor has its own)."""
    with workflow_run("conversation"):
        return _arm_in_run(*args, **kwargs)


def _arm_in_run(rt, action: str, texts: dict, size: int, regime: str, wait_s: float, obs: list[int], tool: Tool,
                decide: bool) -> dict:
    """One action of one trial, from drained caches, over its own token sequences (an earlier
    arm's spill must not be this one's store hit). -> its measured cost (and the policy's
    choice, when ``decide``)."""
    conv = _tokens(rt, texts["conv"], size)
    filler = _tokens(rt, texts["filler"], 2 * size) if regime != "idle" else []
    comp = _tokens(rt, texts["competitor"], size // 2 if regime in ("idle", "room") else 2 * size + size // 2)
    # room for the state, the filler beside it, and the next turn's prefill beside the state
    budget = None if regime == "idle" else (3 * size + 8) * rt.facts.bytes_per_token
    S.drain_kv(rt)
    state = rt.materialize(conv)
    rt.wait([state])
    where = state.state.worker  # the filler, the competitor and the next turn share its worker
    pinned = []  # saturated: the other workers' budgets full of held KV
    if regime == "saturated":
        for other in (w for w in S.workers_of(rt.client) if w != where):
            pinned.append(rt.materialize(_tokens(rt, "held elsewhere " + texts["filler"], 3 * size), worker=other))
        rt.wait(pinned)
    if filler:
        f = rt.materialize(filler, worker=where)
        rt.wait([f])
        rt.release(f)  # evictable cache: a competitor may take its room
    if budget is not None:
        rt.configure(kv_budget_bytes=budget)
    kw = KVWait(rt, forced=action)
    chosen = decide_wait(kw.wait_facts(state, tool)) if decide else None
    states, comp_out = {"conv": state}, {}

    def competitor():  # another workflow run: under the budget, runs wait and are preempted apart
        t = time.time()
        try:
            with workflow_run("competitor"):
                c = rt.materialize(comp, worker=where)
                rt.wait([c])
                rt.release(c)
        except Exception as e:  # noqa: BLE001 -- recorded: a competitor the budget failed still lost its time
            comp_out["error"] = f"{type(e).__name__}: {e}"
        comp_out["seconds"] = time.time() - t

    t0 = time.time()
    kw.begin("conv", states, tool, t0, lambda line: None)
    time.sleep(COMPETITOR_DELAY_S)
    th = threading.Thread(target=competitor, daemon=True)
    th.start()
    while (now := time.time()) < t0 + wait_s:
        due = kw.next_due()
        time.sleep(max(0.0, min(t0 + wait_s, due if due is not None else t0 + wait_s) - now))
        kw.prefetch_due()
    back = t0 + wait_s  # the tool returns: the next turn
    kw.collect(states)
    held = states.pop("conv", None)
    gen, gave_up = None, None
    for attempt in range(RESUME_TRIES):
        try:
            held = held or rt.materialize(conv, worker=where)
            gen = rt.resume(held, obs, max_new_tokens=1, policy="pin")
            break
        except KVPreempted as e:  # released and tried again after a back-off, as the executor does
            gave_up = f"preempted {attempt + 1} times: {str(e)[:160]}"
            if held is not None:
                rt.release(held)
            held = None
            if attempt + 1 < RESUME_TRIES:
                time.sleep(min(5.0, 0.1 * 2 ** attempt))
    # Given up: the turn never ran; its cost is at least the time until then (a lower bound).
    delay = gen.metrics["first_token_at"] - back if gen is not None else time.time() - back
    rt.release_many([s for s in (held, gen.state if gen else None, *pinned) if s is not None])
    kw.close()
    th.join(timeout=120)
    if budget is not None:
        rt.configure(unset_budget=True)
    out = {"action": action, "resume_delay_s": delay, "competitor_s": comp_out.get("seconds", 0.0),
           "competitor_error": comp_out.get("error"), "gave_up": gave_up if gen is None else None,
           "preempted": attempt if gen is not None else attempt + 1,
           "tokens_reused": gen.metrics.get("tokens_reused") if gen else None,
           "resume_worker": gen.worker if gen else None, "state_worker": where, "budget_bytes": budget,
           "cost_s": delay + comp_out.get("seconds", 0.0), "decision": kw.decisions[0]}
    return out | ({"policy": chosen.as_dict()} if chosen is not None else {})


def trials(rt, sizes, regimes=REGIMES, waits_per=2, wait_range=(0.5, 5.0), seed=0, tolerance=(0.1, 0.1),
           log=print) -> dict:
    """Every (size, regime, wait) trial with every action measured. ``tolerance``: (s, fraction)."""
    rng = random.Random(seed)
    tool = _trial_tool()
    HISTORY.clear()
    for _ in range(8):  # the tool's measured durations before the trials: earlier draws of its distribution
        HISTORY.record(history_key(tool), rng.uniform(*wait_range))
    doc = "The agents wait on tools while their key value cache stays, moves to the store, or goes. " * 40
    rows = []
    for size in sizes:
        for regime in regimes:
            for j in range(waits_per):
                wait_s = rng.uniform(*wait_range)
                obs = rt.encode(f" Observation {j}: the tool answered.")
                arms = []
                for i, action in enumerate(WAIT_ACTIONS):
                    tag = f"trial {size} {regime} {j} {action} {rng.random():.6f}: "
                    texts = {k: f"{k} {tag}{doc}" for k in ("conv", "filler", "competitor")}
                    arms.append(_arm(rt, action, texts, size, regime, wait_s, obs, tool, decide=(i == 0)))
                chosen = arms[0]["policy"]["action"]
                cost = {a["action"]: a["cost_s"] for a in arms}
                best = min(cost, key=cost.get)
                allowed = max(tolerance[0], tolerance[1] * cost[best])
                row = {"tokens": size, "regime": regime, "wait_s": wait_s, "budget_bytes": arms[0]["budget_bytes"],
                       "policy": arms[0]["policy"], "chosen": chosen, "best": best, "costs": cost,
                       "right": cost[chosen] <= cost[best] + allowed, "right_strict": chosen == best, "arms": arms}
                rows.append(row)
                log(f"  {size:>5} tok {regime:<9} wait {wait_s:4.2f}s: keep {cost['keep']:.2f} spill "
                    f"{cost['spill']:.2f} drop {cost['drop']:.2f} s -> best {best}, policy {chosen} "
                    f"({'right' if row['right'] else 'WRONG'})")
                HISTORY.record(history_key(tool), wait_s)
    right = sum(r["right"] for r in rows)
    return {"rows": rows, "right": right, "calls": len(rows), "right_rate": right / len(rows) if rows else None,
            "right_strict_rate": sum(r["right_strict"] for r in rows) / len(rows) if rows else None,
            "tolerance": {"seconds": tolerance[0], "fraction": tolerance[1]}}
