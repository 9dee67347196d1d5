"""Experiments 1-5, on one cluster, one model, one set of prompts per point.

exp1  TTFT vs context length at a fixed number of agents (cold, and warm with ``--warm``).
exp2  total workflow time vs number of agents k (cold, and warm with ``--warm``).
exp3  transfer vs recompute: measured transfer of real KV states between workers against
      measured prefill, at loopback bandwidth (and throttled for real by ``netem``), and
      whether the cost model (and the runtime's own plan) picked the faster option, with the
      model's prediction error per point; near-tie rates test the choice where it is hard;
      plus a MODELED sweep over bandwidths from the measured prefill profile.
exp4  peak KV bytes vs branch factor (sampled in worker memory during exp2's runs).
exp5  throughput and framework overhead Omega per system (from exp2's runs).
exp6  multi-round workflows (``multiround.py``); exp7 a stream of workflows (``load.py``).

Every point runs every system on identical prompts (a fresh salt per point and repetition,
so no run reuses another's cache); a system whose tokens differ from text replay's is
marked and its speed is not reported.
"""

from __future__ import annotations

import math
import random
import statistics
import time

from ..policy.cost_model import (
    DEFAULT_LATENCY,
    LinkProfile,
    NeedsCalibration,
    crossover_bandwidth,
    decide,
)
from . import systems as S
from . import worker_tasks as wt
from .common import Progress, log
from .workload import build_workload


def run_row(exp: str, point: dict, rep: int, run: S.SystemRun, wl, agree: bool | None) -> dict:
    ttfts = run.ttfts()
    mem = run.memory or {}
    rss = sum(max(0, m.get("peak_rss", 0) - m.get("start_rss", 0)) for m in mem.values())
    dask_kv = sum(m.get("peak_kv", 0) for m in mem.values())
    shared = run.shared_prefill_wall_s
    ttft_mean = statistics.fmean(ttfts)
    return {
        "exp": exp, **point, "rep": rep, "system": run.system, "phase": run.phase,
        "agents": wl.agents, "prompt_tokens": wl.prompt_tokens, "prefix_tokens": len(wl.prefix),
        "max_new_tokens": wl.max_new_tokens,
        "agree": agree, "wall_s": run.wall_s,
        "ttft_mean_s": ttft_mean, "ttft_p50_s": statistics.median(ttfts), "ttft_min_s": min(ttfts),
        "ttft_max_s": max(ttfts), "shared_prefill_wall_s": shared,
        # cold: no agent's first token can come before the shared context existed; a cold row
        # that cannot say when it existed cannot be checked, and is refused like a violation
        "ttft_invariant_ok": None if run.phase != "cold" else not math.isnan(shared) and ttft_mean >= shared,
        "generated_tokens": run.generated_tokens, "throughput_tok_s": run.generated_tokens / run.wall_s,
        "busiest_compute_s": run.busiest_compute_s, "omega_s": run.overhead_s,
        "omega_frac": run.overhead_s / run.wall_s if run.wall_s else math.nan,
        "prefill_s": run.prefill_s, "decode_s": run.decode_s, "shared_prefill_s": run.shared_prefill_s,
        "tokens_prefilled": run.tokens_prefilled, "kv_bytes_copied": run.kv_bytes_copied,
        "bytes_transferred": run.bytes_transferred, "kv_accounted_bytes": run.kv_accounted_bytes,
        "rss_peak_delta_bytes": rss, "dask_kv_peak_bytes": dask_kv,
        "decisions": dict(run.decisions), "worker_compute_s": dict(run.worker_compute_s),
        "workers_used": sorted({a.worker for a in run.agents}), "batched_branches": run.batched_branches,
    }


def engine_reference(b: S.Bench, run: S.SystemRun, wl) -> float:
    """Mean TTFT of an in-process ``Engine`` resume of ``run``'s branches, batched per worker
    as ``run`` placed them, over a prefix already in memory (the warm-TTFT yardstick)."""
    from . import local_engine as le

    groups: dict[str, list[int]] = {}
    for a in run.agents:
        groups.setdefault(a.worker, []).append(a.index)
    futs = [b.client.submit(le.engine_reference, b.rt.spec, wl.prefix, [wl.suffixes[i] for i in idxs],
                            wl.max_new_tokens, workers=[w], allow_other_workers=False, pure=False)
            for w, idxs in groups.items()]
    ttfts = [t for out in b.client.gather(futs) for t in out["ttfts"]]
    return statistics.fmean(ttfts)


def run_point(b: S.Bench, exp: str, point: dict, context: int, agents: int, max_new: int, systems, reps: int,
              phases=("cold",), progress: Progress | None = None) -> list[dict]:
    """Every system on the same prompts, ``reps`` times (system order rotated per repetition),
    cold (every cache emptied first) and, if asked, warm (the shared context left cached by
    an earlier workflow, ``Workload.primer``, run by the same system). Text replay has no
    cache: it runs cold only, and its cold tokens are the reference of both phases."""
    rt = b.rt
    rows = []
    for rep in range(reps):
        salt = f"{exp}-{'-'.join(f'{k}{v}' for k, v in point.items())}-r{rep}-{random.randrange(1 << 30)}"
        wl = build_workload(rt.tokenizer, context, agents, max_new, salt, rt.facts.max_positions)
        order = list(systems)
        rot = rep % len(order)
        order = order[rot:] + order[:rot]
        if "text" in order:  # the reference runs first so mismatches are known at once
            order.remove("text")
            order.insert(0, "text")
        ref = None
        for phase in phases:
            runs: dict[str, S.SystemRun] = {}
            for name in order:
                if phase == "warm" and name == "text":
                    continue
                try:
                    S.reset_caches(b)
                    if phase == "warm":
                        S.prime(b, name, wl)
                    # memory is sampled where exp 4 reads it (cold exp 2): sampling costs a little CPU
                    runs[name] = S.measured_run(b, name, wl, sample_memory=exp == "exp2" and phase == "cold")
                    runs[name].phase = phase
                    note = f"{runs[name].wall_s:.2f}s"
                except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others' results
                    log(f"  !! {name} failed at {exp} {point} {phase} rep {rep}: {type(e).__name__}: {e}")
                    rows.append({"exp": exp, **point, "rep": rep, "system": name, "phase": phase, "agree": None,
                                 "error": f"{type(e).__name__}: {e}"})
                    note = "FAILED"
                if progress:
                    progress.step(f"{exp} {point} {phase} rep{rep} {name} {note}")
            if "text" in runs:
                ref = runs["text"].tokens()
            for name in systems:
                if name not in runs:
                    continue
                agree = None if ref is None else runs[name].tokens() == ref
                if agree is False:
                    log(f"  !! {name} outputs differ from text replay at {exp} {point} {phase} rep {rep}: "
                        "speed not reported")
                row = run_row(exp, point, rep, runs[name], wl, agree)
                if row["ttft_invariant_ok"] is False:
                    log(f"  !! {name} at {exp} {point} rep {rep}: mean TTFT {row['ttft_mean_s']:.3f}s before the "
                        f"shared context was ready ({row['shared_prefill_wall_s']:.3f}s): a timing bug")
                if phase == "warm" and name == "dkv" and rep == 0:
                    try:
                        row["engine_ttft_mean_s"] = engine_reference(b, runs[name], wl)
                    except Exception as e:  # noqa: BLE001 -- a yardstick, not a result
                        log(f"  engine reference failed: {type(e).__name__}: {e}")
                rows.append(row)
    S.reset_caches(b)
    return rows


def exp1(b, contexts, agents, max_new, systems, reps, phases=("cold",), progress=None) -> list[dict]:
    rows = []
    for ctx in contexts:
        rows += run_point(b, "exp1", {"context": ctx}, ctx, agents, max_new, systems, reps, phases, progress)
    return rows


def exp2(b, context, ks, max_new, systems, reps, phases=("cold",), progress=None) -> list[dict]:
    rows = []
    for k in ks:
        rows += run_point(b, "exp2", {"k": k}, context, k, max_new, systems, reps, phases, progress)
    return rows


# -- exp 3 ------------------------------------------------------------------------------------------
NEAR_TIE = 0.30  # transfer and recompute within 30% of each other: a near tie


def _rel_err(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; nan when either is missing."""
    if predicted is None or measured is None or any(math.isnan(x) for x in (predicted, measured)) or measured <= 0:
        return math.nan
    return (predicted - measured) / measured


def near_tie_rates(rows: list[dict], contexts, factors=(0.85, 1.2)) -> list[tuple[float, list[int]]]:
    """Link rates (Mbit/s) that put transfer within ~30% of recompute, per context, from the
    loopback rows' measured recompute times: the tie rate is KV bytes / recompute seconds;
    ``factors`` below 1 make the transfer the slower option. [(rate, [context])]."""
    jobs = []
    for n in contexts:
        got = [r for r in rows if r["context"] == n and r.get("recompute_s")]
        if not got:
            continue
        tie = statistics.median(r["kv_bytes"] * 8 / r["recompute_s"] / 1e6 for r in got)
        jobs += [(round(tie * f, 1), [n]) for f in factors]
    return jobs


def _random_tokens(rt, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, rt.facts.vocab_size) for _ in range(n)]


def _decision(rt, nbytes, tokens, src, dst):
    view = rt.view()
    link, prof = view.link(src, dst), view.profile(dst)
    if link is None or prof is None:
        rt.calibrate()
        view = rt.view()
        link, prof = view.link(src, dst), view.profile(dst)
    try:
        return decide(nbytes, tokens, 0, src, dst, link, prof), link, prof
    except NeedsCalibration:
        return None, link, prof


def transfer_vs_recompute_point(rt, src: str, dst: str, tokens_n: int, seed: int, runtime_decision: bool = True,
                                label: str = "loopback", probe_bandwidth: float | None = None) -> dict:
    """Measure moving a real ``tokens_n``-token state src->dst against prefilling it on dst.

    The cost model is asked twice: with the bandwidth the runtime's view holds (what the
    planner uses: Dask's own transfer estimate when it has one, else the calibration probe)
    and, if given, with ``probe_bandwidth`` (this link's fresh calibration probe).
    """
    client = rt.client
    toks = _random_tokens(rt, tokens_n, seed)
    t0 = time.perf_counter()
    st = rt.materialize(toks, worker=src)
    rt.wait([st])
    materialize_s = time.perf_counter() - t0
    keys = set(st.state.block_keys)
    nbytes = st.nbytes

    # the decision is taken before this point's own transfer updates Dask's bandwidth estimate
    d, link, prof = _decision(rt, nbytes, tokens_n, src, dst)

    client.run(wt.clear_transfer_log, workers=[dst])
    t0 = time.perf_counter()
    fut = client.submit(wt.nbytes_of, *st.futures, workers=[dst], allow_other_workers=False, pure=False)
    got = fut.result()
    transfer_wall = time.perf_counter() - t0
    log_entries = [e for e in client.run(wt.transfer_log, workers=[dst])[dst] if keys & set(e["keys"])]
    moved = sum(v for e in log_entries for k, v in e["keys"].items() if k in keys)
    span = (max(e["stop"] for e in log_entries) - min(e["start"] for e in log_entries)) if log_entries else math.nan
    del fut

    t0 = time.perf_counter()
    res = rt.generate_text(toks, 1, worker=dst).result()
    recompute_wall = time.perf_counter() - t0
    recompute_s = res.metrics["prefill_s"]
    rt.release(st)
    del st

    row = {
        "label": label, "context": tokens_n, "src": src, "dst": dst, "kv_bytes": nbytes, "bytes_received": moved,
        "bytes_checked": got, "materialize_s": materialize_s,
        "transfer_s": span, "transfer_wall_s": transfer_wall,
        "transfer_gbps": (moved / span / 1e9) if span and span > 0 else math.nan,
        "recompute_s": recompute_s, "recompute_wall_s": recompute_wall,
        "faster": "transfer" if span < recompute_s else "recompute",
        "faster_wall": "transfer" if transfer_wall < recompute_wall else "recompute",
        "model_bandwidth_gbps": link.bandwidth / 1e9 if link else math.nan,
        "model_latency_s": link.latency if link else math.nan,
        "model_t_transfer_s": d.t_transfer if d else math.nan,
        "model_t_recompute_s": d.t_recompute if d else math.nan,
        "model_action": d.action if d else "needs-calibration",
        "model_crossover_gbps": (crossover_bandwidth(nbytes, tokens_n, prof, link.latency) / 1e9
                                 if (prof and link) else math.nan),
    }
    row["model_correct"] = row["model_action"] == row["faster"]
    row["err_transfer"] = _rel_err(row["model_t_transfer_s"], span)
    row["err_recompute"] = _rel_err(row["model_t_recompute_s"], recompute_s)
    if probe_bandwidth and prof is not None:
        dp = decide(nbytes, tokens_n, 0, src, dst, LinkProfile(probe_bandwidth, link.latency if link else DEFAULT_LATENCY),
                    prof)
        row.update(probe_bandwidth_gbps=probe_bandwidth / 1e9, probe_model_action=dp.action,
                   probe_model_t_transfer_s=dp.t_transfer, probe_model_correct=dp.action == row["faster"],
                   probe_err_transfer=_rel_err(dp.t_transfer, span))
    ratio = math.nan if math.isnan(span) else span / recompute_s
    row["transfer_over_recompute"] = ratio
    row["near_tie"] = None if math.isnan(ratio) else bool(1 / (1 + NEAR_TIE) <= ratio <= 1 + NEAR_TIE)

    if runtime_decision:  # the runtime's own plan for a branch placed on dst, on a fresh state
        st2 = rt.materialize(_random_tokens(rt, tokens_n, seed + 7919), worker=src)
        rt.wait([st2])
        br = rt.fork(st2, 1)
        t0 = time.perf_counter()
        # The question is how dst gets the prefix: the plan may use dst only (left free,
        # earliest finish would rather run the branch where the blocks are).
        gens = rt.resume_many([(b, _random_tokens(rt, 4, seed + i)) for i, b in enumerate(br)], 1, policy="auto",
                              workers=[dst])
        row["runtime_resume_wall_s"] = time.perf_counter() - t0
        on_dst = [g for g in gens if g.worker == dst]
        row["runtime_action"] = on_dst[0].placement.action if on_dst else "not-placed-on-dst"
        row["runtime_correct"] = row["runtime_action"] == row["faster"]
        for g in gens:
            rt.release(g.state)
        for b in br:
            rt.release(b)
        rt.release(st2)
        del gens, br, st2
    S.drain_kv(rt, timeout=10)
    return row


def modeled_sweep(rt, contexts, bandwidths_gbps, dst: str, latency: float = DEFAULT_LATENCY) -> list[dict]:
    """MODELED: the cost model's choice at bandwidths we did not run, from dst's measured profile."""
    prof = rt.view().profile(dst)
    if prof is None:
        rt.calibrate()
        prof = rt.view().profile(dst)
    rows = []
    for n in contexts:
        nbytes = n * rt.facts.bytes_per_token
        for bw in bandwidths_gbps:
            d = decide(nbytes, n, 0, "src", dst, LinkProfile(bw * 1e9, latency), prof)
            rows.append({"label": "MODELED", "context": n, "bandwidth_gbps": bw, "kv_bytes": nbytes,
                         "t_transfer_s": d.t_transfer, "t_recompute_s": d.t_recompute, "action": d.action,
                         "crossover_gbps": crossover_bandwidth(nbytes, n, prof, latency) / 1e9})
    return rows


def exp3_loopback(rt, contexts, workers, reps: int = 1, progress=None, probe_bytes: int = 32 << 20,
                  calibration: dict | None = None) -> list[dict]:
    """``calibration``: a fresh ``rt.calibrate`` result that covered ``max(contexts)`` tokens
    (else one is taken: a profile fitted on short prefills alone mispredicts long ones)."""
    src, dst = workers[0], workers[1]
    cal = calibration or rt.calibrate(probe_bytes=probe_bytes, probe_tokens=max(contexts))
    probe = cal["bandwidth"].get(f"{src}->{dst}")
    rows = []
    for rep in range(reps):
        for n in contexts:
            row = transfer_vs_recompute_point(rt, src, dst, n, seed=1000 * rep + n, label="loopback",
                                              probe_bandwidth=probe)
            row["rep"] = rep
            rows.append(row)
            if progress:
                progress.step(f"exp3 loopback {n} tok: transfer {row['transfer_s']:.3f}s recompute "
                              f"{row['recompute_s']:.3f}s -> {row['model_action']}")
    return rows
