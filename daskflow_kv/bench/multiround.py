"""Exp 6: multi-round workflows, where KV state crosses rounds and levels.

Two workflows from ``workflows/``, on one shared context of ``context`` tokens:

debate   3 debaters x 3 rounds + a moderator: round r's prompts start with the topic and
         every earlier round's messages, so each round's shared prefix extends the last.
planner  planner -> 3 solvers -> judge: the solvers share the task, the plan and the
         retrieved passages; the judge reads the task, the plan and every solution.

Systems: ``text`` (``executor.run_text_mode``), ``dkv`` (``executor.run_state_mode``: each
level's group prefix is materialized from whatever an earlier level left cached, on any
worker) and ``local`` (``run_local_mode`` here: per-worker engines whose prefix caches
persist across levels, groups routed by the cache-aware router; a worker that lacks a
prefix prefills it, nothing moves between workers). Every system runs cold (all caches
emptied) on the same prompts; tokens must match text replay's, agent by agent.

Per run: wall time, mean TTFT from the workflow's start, mean TTFT per round (from the
round's start), tokens prefilled, and when the first copy of the first round's shared
context existed (``shared_prefill_wall_s``).
"""

from __future__ import annotations

import math
import random
import statistics
import time

from ..flow.compiler import compile_workflow, level_groups
from ..flow.executor import run_state_mode, run_text_mode, taken_levels
from ..flow.prompts import prompt_tokens
from ..runtime.workflow_gate import admitted
from ..runtime.workflow_run import new_run_name
from ..workflows import debate, planner_solvers
from . import systems as S
from .common import Progress, log

WORKFLOWS = ("debate", "planner")
SYSTEMS = ("text", "local", "dkv")


def build(name: str, tokenizer, context: int, max_new: int, salt: str):
    if name == "debate":
        wf = debate.build(agents=3, rounds=3, context_tokens=context, max_new_tokens=max_new, tokenizer=tokenizer)
    elif name == "planner":
        wf = planner_solvers.build(agents=3, context_tokens=context, max_new_tokens=max_new, tokenizer=tokenizer)
    else:
        raise ValueError(f"unknown exp6 workflow {name!r}; expected one of {WORKFLOWS}")
    wf.system = f"Session {salt}. {wf.system}"  # no run reuses another's blocks
    return wf


# -- the local baseline over a compiled workflow ----------------------------------------------------
def run_local_mode(cw, b: S.Bench, grow=None) -> dict:
    """Level by level like the executor; each group of agents sharing a prefix is routed
    over the per-worker engines and decoded as a batch there. {agents, wall_s, ...}. It passes
    the cluster's workflow gate as the executor's modes do. ``grow``: a workflow with tools or
    steps, its levels taken as it grows (``flow.growing``; its tools run as in the other modes)."""
    with admitted(b.rt.plugin, new_run_name(cw.workflow.name)) as waited:
        out = _local_levels(cw, b, grow)
    out["gate_wait_s"] = waited
    return out


def _local_levels(cw, b: S.Bench, grow=None) -> dict:
    rt, wf = b.rt, cw.workflow
    outputs: dict[str, str] = {}
    agents: dict[str, dict] = {}
    level_tokens, level_outs, prefills = [], [], []
    t0, wall0 = time.perf_counter(), time.time()
    for lvl, names in taken_levels(cw, grow, outputs):
        level_at = time.time()
        prompts = {n: prompt_tokens(wf, wf.agents[n], outputs, rt.tokenizer) for n in names}
        pending = []
        for group in level_groups(wf, prompts, rt.block_size):
            buckets: dict[int, list[str]] = {}
            for m in group.members:
                buckets.setdefault(wf.agents[m].max_new_tokens, []).append(m)
            for max_new, members in buckets.items():
                prefix = prompts[members[0]][: group.prefix_len]
                suffixes = [prompts[m][group.prefix_len:] for m in members]
                pending.append((members, prefix, suffixes, S.submit_local(b, prefix, suffixes, max_new)))
        computed, outs_here = 0, []
        for members, prefix, suffixes, sub in pending:
            for out in S.finish_local(b, prefix, suffixes, sub):
                outs_here.append(out)
                computed += out["prefix_tokens_computed"]
                if out["prefix_tokens_computed"]:
                    prefills.append({"level": lvl, "op": "materialize", "worker": out["worker"],
                                     "tokens": out["prefix_tokens_computed"]})
                for br in out["branches"]:
                    name = members[br["index"]]
                    outputs[name] = rt.decode(br["tokens"])
                    computed += br["tokens_computed"]
                    prefills.append({"level": lvl, "op": "resume", "worker": out["worker"],
                                     "tokens": br["tokens_computed"]})
                    agents[name] = {"level": lvl, "tokens": br["tokens"], "worker": out["worker"],
                                    "first_token_at": br["first_token_at"], "level_started_at": level_at}
        level_tokens.append(computed)
        level_outs.append(outs_here)
        if grow is not None:
            grow.after_level(names, outputs, None)
    return {"agents": agents, "wall_s": time.perf_counter() - t0, "start": wall0, "level_tokens": level_tokens,
            "shared_ready_at": S.first_ready(wall0, level_outs[0]) if level_outs else None, "prefills": prefills}


def _from_executor(res) -> dict:
    agents = {n: {"level": a.level, "tokens": a.tokens, "worker": a.worker, "first_token_at": a.first_token_at,
                  "level_started_at": a.level_started_at} for n, a in res.agents.items()}
    start = min(a.level_started_at for a in res.agents.values())
    return {"agents": agents, "wall_s": res.wall_s, "start": start, "level_tokens": list(res.level_tokens_computed)}


def run_system(b: S.Bench, system: str, cw) -> dict:
    if system == "text":
        t0 = time.time()
        out = _from_executor(run_text_mode(cw, b.rt))
        out["start"] = t0
        lvl0 = [a["first_token_at"] for a in out["agents"].values() if a["level"] == 0]
        out["shared_ready_at"] = min(lvl0)  # text replay: its first prompt prefill's end
        return out
    if system == "local":
        return run_local_mode(cw, b)
    if system == "dkv":
        t0 = time.time()
        res = run_state_mode(cw, b.rt)
        out = _from_executor(res)
        out["start"] = t0
        evs = S.prefill_events(b.client, t0)
        made = S.made_at([e for e in evs if e["op"] in ("materialize", "recompute")])
        lvl0 = [a["first_token_at"] for a in out["agents"].values() if a["level"] == 0]
        out["shared_ready_at"] = min(made + [min(lvl0)])  # nothing materialized: a resume prefilled it
        out["decisions"] = _decisions(res)
        return out
    raise ValueError(f"exp6 runs text, local and dkv, not {system!r}")


def _decisions(res) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in res.agents.values():
        out[a.decision] = out.get(a.decision, 0) + 1
    return out


def _row(workflow: str, rep: int, system: str, out: dict, agree, levels: int) -> dict:
    agents = out["agents"].values()
    start = out["start"]
    ttfts = [a["first_token_at"] - start for a in agents]
    rounds = [statistics.fmean(a["first_token_at"] - a["level_started_at"] for a in agents if a["level"] == lvl)
              for lvl in range(levels)]
    shared = math.nan if out.get("shared_ready_at") is None else max(0.0, out["shared_ready_at"] - start)
    mean = statistics.fmean(ttfts)
    return {
        "exp": "exp6", "workflow": workflow, "rep": rep, "system": system, "phase": "cold", "agree": agree,
        "agents": len(ttfts), "levels": levels, "wall_s": out["wall_s"], "ttft_mean_s": mean,
        "ttft_min_s": min(ttfts), "round_ttft_s": rounds, "shared_prefill_wall_s": shared,
        "ttft_invariant_ok": None if math.isnan(shared) else mean >= shared,
        "tokens_prefilled": sum(out["level_tokens"]), "level_tokens": out["level_tokens"],
        "generated_tokens": sum(len(a["tokens"]) for a in agents), "decisions": out.get("decisions", {}),
        "workers_used": sorted({a["worker"] for a in agents}),
    }


def exp6(b: S.Bench, workflows, context: int, max_new: int, systems, reps: int,
         progress: Progress | None = None) -> list[dict]:
    rt = b.rt
    systems = [s for s in systems if s in SYSTEMS]
    rows = []
    for name in workflows:
        for rep in range(reps):
            salt = f"exp6-{name}-r{rep}-{random.randrange(1 << 30)}"
            wf = build(name, rt.tokenizer, context, max_new, salt)
            order = ["text"] + [s for s in systems if s != "text"] if "text" in systems else list(systems)
            rot = rep % max(1, len(order) - 1)
            order = order[:1] + order[1:][rot:] + order[1:][:rot]
            outs, ref = {}, None
            for system in order:
                try:
                    S.reset_caches(b)
                    cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
                    outs[system] = (run_system(b, system, cw), len(cw.levels))
                    note = f"{outs[system][0]['wall_s']:.2f}s"
                except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
                    log(f"  !! {system} failed at exp6 {name} rep {rep}: {type(e).__name__}: {e}")
                    rows.append({"exp": "exp6", "workflow": name, "rep": rep, "system": system, "phase": "cold",
                                 "agree": None, "error": f"{type(e).__name__}: {e}"})
                    note = "FAILED"
                if progress:
                    progress.step(f"exp6 {name} rep{rep} {system} {note}")
            if "text" in outs:
                ref = {n: a["tokens"] for n, a in outs["text"][0]["agents"].items()}
            for system in systems:
                if system not in outs:
                    continue
                out, levels = outs[system]
                agree = None if ref is None else all(out["agents"][n]["tokens"] == t for n, t in ref.items())
                if agree is False:
                    log(f"  !! {system} outputs differ from text replay at exp6 {name} rep {rep}")
                rows.append(_row(name, rep, system, out, agree, levels))
    S.reset_caches(b)
    return rows
