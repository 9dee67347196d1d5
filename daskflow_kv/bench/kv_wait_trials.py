"""Issue 55's decision check: for each tool call, keep / spill / drop all measured, and the
policy's choice scored against the best of the three.

A trial is one call: a conversation state of ``tokens`` tokens, a tool wait drawn from
[lo, hi] s, and a regime:

idle       no budget: nothing needs the room;
room       the budget is full (the state and an evictable filler); a competitor arrives
           during the wait and fits by evicting the filler;
contended  as room, but the competitor needs more than the filler frees: the state's room too.

Each action runs from the same start (caches drained, state and filler built again): the
action applied (``flow.kv_wait.KVWait``, forced), the competitor started 0.1 s into the
wait, the tool "returns" after the wait, and the next turn resumes with an observation
(one token). cost = the next turn's delay after the return (to its first token) + the
competitor's time from its start until its blocks exist: what the conversation and its
neighbour lost. The policy's choice is the real ``KVWait`` decision at the call (the
worker's KV and budget, the store's and the prefill's measured speed, the tool's measured
durations: earlier draws of the same distribution); it is right when its cost is within
``tolerance`` (s, or that fraction of the best) of the best action's.
"""

from __future__ import annotations

import random
import threading
import time

from ..flow.kv_wait import KVWait
from ..flow.spec import Tool
from ..flow.tool_calls import HISTORY, history_key
from ..policy.kv_wait import WAIT_ACTIONS, decide_wait
from . import systems as S

REGIMES = ("idle", "room", "contended")
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


def _arm(rt, action: str, conv: list[int], filler: list[int], comp: list[int], obs: list[int], wait_s: float,
         budget: int | None, tool: Tool, decide: bool) -> dict:
    """One action of one trial, from drained caches. -> its measured cost (and the policy's
    choice, when ``decide``)."""
    S.drain_kv(rt)
    state = rt.materialize(conv)
    rt.wait([state])
    if filler:
        f = rt.materialize(filler)
        rt.wait([f])
        rt.release(f)  # evictable cache: a competitor may take its room
    if budget is not None:
        rt.configure(kv_budget_bytes=budget)
    kw = KVWait(rt, forced=action)
    chosen = decide_wait(kw._facts(state, tool)) if decide else None
    states, comp_out = {"conv": state}, {}

    def competitor():
        t = time.time()
        try:
            c = rt.materialize(comp)
            rt.wait([c])
            rt.release(c)
        except Exception as e:  # noqa: BLE001 -- recorded: a competitor the budget failed still lost its time
            comp_out["error"] = f"{type(e).__name__}: {e}"
        comp_out["seconds"] = time.time() - t

    t0 = time.time()
    kw.begin("conv", states, tool, t0, lambda line: None)
    th = None
    if comp:
        time.sleep(COMPETITOR_DELAY_S)
        th = threading.Thread(target=competitor, daemon=True)
        th.start()
    while (now := time.time()) < t0 + wait_s:
        due = kw.next_due()
        time.sleep(max(0.0, min(t0 + wait_s, due if due is not None else t0 + wait_s) - now))
        kw.prefetch_due(states)
    back = time.time()  # the tool returns: the next turn
    held = states.pop("conv", None) or rt.materialize(conv)
    gen = rt.resume(held, obs, max_new_tokens=1)
    delay = gen.metrics["first_token_at"] - back
    rt.release_many([held, gen.state])
    if th is not None:
        th.join(timeout=120)
    if budget is not None:
        rt.configure(unset_budget=True)
    out = {"action": action, "resume_delay_s": delay, "competitor_s": comp_out.get("seconds", 0.0),
           "competitor_error": comp_out.get("error"), "tokens_reused": gen.metrics.get("tokens_reused"),
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
    bpt = rt.facts.bytes_per_token
    doc = "The agents wait on tools while their key value cache stays, moves to the store, or goes. " * 40
    rows = []
    for size in sizes:
        for regime in regimes:
            for j in range(waits_per):
                wait_s = rng.uniform(*wait_range)
                tag = f"trial {size} {regime} {j} {rng.random():.6f}: "
                conv = _tokens(rt, tag + doc, size)
                filler = _tokens(rt, "filler " + tag + doc, size) if regime != "idle" else []
                comp_n = size // 2 if regime == "room" else size + size // 2
                comp = _tokens(rt, "competitor " + tag + doc, comp_n) if regime != "idle" else \
                    _tokens(rt, "competitor " + tag + doc, size // 2)
                budget = None if regime == "idle" else (2 * size + 8) * bpt
                obs = rt.encode(f" Observation {j}: the tool answered.")
                arms = [_arm(rt, a, conv, filler, comp, obs, wait_s, budget, tool, decide=(i == 0))
                        for i, a in enumerate(WAIT_ACTIONS)]
                chosen = arms[0]["policy"]["action"]
                cost = {a["action"]: a["cost_s"] for a in arms}
                best = min(cost, key=cost.get)
                allowed = max(tolerance[0], tolerance[1] * cost[best])
                row = {"tokens": size, "regime": regime, "wait_s": wait_s, "budget_bytes": budget,
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
