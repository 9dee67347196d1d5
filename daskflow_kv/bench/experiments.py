"""Experiments 1-5 of issue 7, on one cluster, one model, one set of prompts per point.

exp1  TTFT vs context length at a fixed number of agents.
exp2  total workflow time vs number of agents k.
exp3  transfer vs recompute: measured transfer of real KV states between workers against
      measured prefill, at loopback bandwidth (and throttled for real by ``netem``), and
      whether the cost model (and the runtime's own plan) picked the faster option; plus a
      MODELED sweep over bandwidths from the measured prefill profile.
exp4  peak KV bytes vs branch factor (sampled in worker memory during exp2's runs).
exp5  throughput and framework overhead Omega per system (from exp2's runs).

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


def _run_row(exp: str, point: dict, rep: int, run: S.SystemRun, wl, agree: bool | None) -> dict:
    ttfts = run.ttfts()
    mem = run.memory or {}
    rss = sum(max(0, m.get("peak_rss", 0) - m.get("start_rss", 0)) for m in mem.values())
    dask_kv = sum(m.get("peak_kv", 0) for m in mem.values())
    return {
        "exp": exp, **point, "rep": rep, "system": run.system,
        "agents": wl.agents, "prompt_tokens": wl.prompt_tokens, "prefix_tokens": len(wl.prefix),
        "max_new_tokens": wl.max_new_tokens,
        "agree": agree, "wall_s": run.wall_s,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
        "generated_tokens": run.generated_tokens, "throughput_tok_s": run.generated_tokens / run.wall_s,
        "busiest_compute_s": run.busiest_compute_s, "omega_s": run.overhead_s,
        "omega_frac": run.overhead_s / run.wall_s if run.wall_s else math.nan,
        "prefill_s": run.prefill_s, "decode_s": run.decode_s, "shared_prefill_s": run.shared_prefill_s,
        "tokens_prefilled": run.tokens_prefilled, "kv_bytes_copied": run.kv_bytes_copied,
        "bytes_transferred": run.bytes_transferred, "kv_accounted_bytes": run.kv_accounted_bytes,
        "rss_peak_delta_bytes": rss, "dask_kv_peak_bytes": dask_kv,
        "decisions": dict(run.decisions), "worker_compute_s": dict(run.worker_compute_s),
    }


def run_point(rt, exp: str, point: dict, context: int, agents: int, max_new: int, systems, workers, reps: int,
              progress: Progress | None = None) -> list[dict]:
    """Every system on the same prompts, ``reps`` times (system order rotated per repetition)."""
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
        runs: dict[str, S.SystemRun] = {}
        for name in order:
            try:
                if name.startswith("dkv"):
                    S.drain_kv(rt, timeout=10)
                runs[name] = S.measured_run(rt, name, wl, workers)
                note = f"{runs[name].wall_s:.2f}s"
            except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others' results
                log(f"  !! {name} failed at {exp} {point} rep {rep}: {type(e).__name__}: {e}")
                rows.append({"exp": exp, **point, "rep": rep, "system": name, "agree": None,
                             "error": f"{type(e).__name__}: {e}"})
                note = "FAILED"
            if progress:
                progress.step(f"{exp} {point} rep{rep} {name} {note}")
        ref = runs["text"].tokens() if "text" in runs else None
        for name in systems:
            if name not in runs:
                continue
            agree = None if ref is None else runs[name].tokens() == ref
            if agree is False:
                log(f"  !! {name} outputs differ from text replay at {exp} {point} rep {rep}: speed not reported")
            rows.append(_run_row(exp, point, rep, runs[name], wl, agree))
    S.drain_kv(rt, timeout=10)
    return rows


def exp1(rt, contexts, agents, max_new, systems, workers, reps, progress=None) -> list[dict]:
    rows = []
    for ctx in contexts:
        rows += run_point(rt, "exp1", {"context": ctx}, ctx, agents, max_new, systems, workers, reps, progress)
    return rows


def exp2(rt, context, ks, max_new, systems, workers, reps, progress=None) -> list[dict]:
    rows = []
    for k in ks:
        rows += run_point(rt, "exp2", {"k": k}, context, k, max_new, systems, workers, reps, progress)
    return rows


# -- exp 3 ------------------------------------------------------------------------------------------
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
    if probe_bandwidth and prof is not None:
        dp = decide(nbytes, tokens_n, 0, src, dst, LinkProfile(probe_bandwidth, link.latency if link else DEFAULT_LATENCY),
                    prof)
        row.update(probe_bandwidth_gbps=probe_bandwidth / 1e9, probe_model_action=dp.action,
                   probe_model_t_transfer_s=dp.t_transfer, probe_model_correct=dp.action == row["faster"])
    margin = math.nan if math.isnan(span) else abs(span - recompute_s) / max(span, recompute_s)
    row["near_tie"] = None if math.isnan(margin) else bool(margin < 0.15)

    if runtime_decision:  # the runtime's own plan for a branch placed on dst, on a fresh state
        st2 = rt.materialize(_random_tokens(rt, tokens_n, seed + 7919), worker=src)
        rt.wait([st2])
        br = rt.fork(st2, 2)
        t0 = time.perf_counter()
        gens = rt.resume_many([(b, _random_tokens(rt, 4, seed + i)) for i, b in enumerate(br)], 1, policy="auto")
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


def exp3_loopback(rt, contexts, workers, reps: int = 1, progress=None, probe_bytes: int = 32 << 20) -> list[dict]:
    src, dst = workers[0], workers[1]
    cal = rt.calibrate(probe_bytes=probe_bytes)
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
