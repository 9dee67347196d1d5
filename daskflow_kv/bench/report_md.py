"""The markdown of a bench run: SUMMARY.md, every table (the README blocks: ``readme_blocks``).

Every number comes from the run's summary rows (``report.summarize``) or its exp 3 rows:
medians over repetitions with their spread (min-max), cold and warm side by side, and
daskflow-kv's ratio against the *best* baseline at each point. Rows refused by the
summary (MISMATCH, INVALID) print as such, never as numbers.
"""

from __future__ import annotations

import math

from . import exp7_modeled, provenance
from .common import mib
from .exp7_why import why as exp7_why
from .summary import (BASELINES, OVERHEAD_FIELDS, POINT_KEY, SUBJECT, exp3_errors, gain, saturation, targets,
                      usable, value)
from .systems import LABELS

BASELINE_NOTES = {
    "text": "every agent prefills its whole prompt; no cache, so it has no warm phase (its cold run stands "
            "for both). Gets: nothing shared. Does not get: any reuse.",
    "hf": "the plain Hugging Face recipe per worker: prefill the shared prompt once into a DynamicCache, "
          "deepcopy it per branch, `generate` the branches one after another (round-robin over workers); "
          "the prompt cache stays in the worker for the next run with the same prefix (warm). Gets: prefix "
          "reuse on each worker. Does not get: batched decode, partial-prefix reuse, moving KV between workers.",
    "local": "one engine per worker (`Engine`: automatic prefix cache, LRU-kept, any cached prefix reused "
             "to the token) decoding the branches it serves as one batch (`resume_forks`), behind a "
             "cache-aware router that places each agent where it would finish first (queue + missing prefix "
             "+ batch, from the same measured prefill profiles as the planner): what a vLLM/SGLang instance "
             "per worker behind an SGLang-style router gives. Gets: prefix caching, batching, cache-aware "
             "routing, parallel prefill on idle workers. Does not get: moving KV between workers (a worker "
             "that lacks a prefix prefills it).",
    "dkv": "daskflow-kv: content-addressed KV blocks on Dask workers, shared by every client; the planner "
           "places branches by earliest finish time (reuse, transfer or recompute per worker), batched "
           "decode of co-located branches.",
}


def _cell(x, fmt="{:.3f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def find_row(summary, exp, point, system, phase):
    key = POINT_KEY[exp]
    return next((r for r in summary if r["exp"] == exp and r[key] == point and r["system"] == system
                 and r["phase"] == phase), None)


def metric_cell(r, metric, fmt="{:.3f}", spread=False) -> str:
    if r is None:
        return "-"
    if r.get("invalid"):
        return r["invalid"]
    if not r.get("reps"):
        return "FAILED"
    if metric in OVERHEAD_FIELDS and r.get("overhead_invalid"):
        return "INVALID"
    v = value(r, metric)
    text = _cell(v, fmt)
    lo, hi = r.get(metric + "_min"), r.get(metric + "_max")
    if spread and v is not None and lo is not None and r["reps"] > 1:
        text += f" ({fmt.format(lo)}-{fmt.format(hi)})"
    return text


def exp_points(summary, exp):
    key = POINT_KEY[exp]
    return sorted({r[key] for r in summary if r["exp"] == exp}, key=lambda p: (str(type(p)), p))


def grid(summary, exp, metric, title, fmt="{:.3f}", spread=True, higher_better=False) -> list[str]:
    """Points x systems, each cell "cold / warm" (warm only where measured); then the ratios."""
    rows = [r for r in summary if r["exp"] == exp]
    if not rows:
        return []
    key = POINT_KEY[exp]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    phases = [p for p in ("cold", "warm", "stream") if any(r["phase"] == p for r in rows)]
    lines = [f"**{title}** (median over repetitions, (min-max) when more than one; "
             + (" / ".join(phases) + " per cell" if len(phases) > 1 else phases[0]) + ")", ""]
    body = []
    for p in exp_points(summary, exp):
        cells = [str(p)]
        for s in systems:
            parts = [metric_cell(find_row(summary, exp, p, s, ph), metric, fmt, spread) for ph in phases]
            if s == "text" and "warm" in phases:
                parts[phases.index("warm")] = "(cold)"
            cells.append(" / ".join(parts))
        body.append(cells)
    lines += md_table([key] + [LABELS.get(s, s) for s in systems], body) + [""]
    if SUBJECT in systems and any(s in BASELINES for s in systems):
        word = "daskflow-kv / best baseline" if higher_better else "best baseline / daskflow-kv"
        lines += [f"Ratio {word} (>1: daskflow-kv better), and which baseline was best:", ""]
        body = []
        for p in exp_points(summary, exp):
            cells = [str(p)]
            for ph in phases:
                g, name = gain(summary, exp, p, ph, metric, higher_better)
                cells.append("-" if g is None else f"{g:.2f}x ({name})")
            body.append(cells)
        lines += md_table([key] + [f"{ph}" for ph in phases], body) + [""]
    return lines


def _targets_lines(doc, summary) -> list[str]:
    ts = doc.get("targets") or targets(doc, summary)
    body = [[t["target"], {True: "met", False: "**MISSED**", None: "not measured"}[t["ok"]], t["detail"]]
            for t in ts]
    lines = ["## Targets", ""] + md_table(["target", "result", "measured"], body) + [""]
    notes = doc.get("notes") or {}
    for t in ts:
        if t["ok"] is False:
            lines.append(f"- Why *{t['target']}* was missed: {notes.get(t['target'], 'see the tables below; ')}"
                         + _auto_why(t, summary) + _exp7_auto_why(t, doc, summary))
    return lines + [""]


def _auto_why(t, summary) -> str:
    """Facts that explain a missed wall-time target: where daskflow-kv's wall went."""
    if "wall" not in t["target"] or "worst" not in t["detail"]:
        return ""
    worst = []
    for r in summary:
        if r["system"] == SUBJECT and r["phase"] == "cold" and r["exp"] in ("exp1", "exp2") and usable(r):
            g, name = gain(summary, r["exp"], r[POINT_KEY[r["exp"]]], "cold", "wall_s")
            if g is not None:
                worst.append((g, r, name))
    if not worst:
        return ""
    g, r, name = min(worst, key=lambda w: w[0])
    return (f"at {r['exp']} {POINT_KEY[r['exp']]}={r[POINT_KEY[r['exp']]]} daskflow-kv's wall was "
            f"{_cell(r['wall_s'])} s: {_cell(r.get('busiest_compute_s'))} s of model compute on its busiest worker "
            f"and {_cell(r.get('omega_s'))} s outside it (scheduling, dispatch, transfers, block handling); "
            f"it prefilled {_cell(r.get('tokens_prefilled'), '{:.0f}')} tokens.")


def _exp7_auto_why(t, doc, summary) -> str:
    """Where the prefill work went at the saturation points an exp 7 target compared."""
    words = t["target"].split()
    if words[:2] != ["exp", "7"] or "local's" not in t["target"]:
        return ""
    sat = saturation(summary, words[2].rstrip(":"))
    if SUBJECT not in sat or "local" not in sat:
        return ""

    def runs(row):
        return [r for r in doc.get("runs", []) if r.get("exp") == "exp7" and r.get("point") == row["point"]
                and r["system"] == row["system"] and not r.get("error")]

    return exp7_why(runs(sat[SUBJECT]), runs(sat["local"]))


def _exp3_lines(doc) -> list[str]:
    rows = doc.get("exp3") or []
    lines = []
    if rows:
        head = ["link", "tokens", "KV MiB", "transfer s", "model s", "err", "Mbit/s", "recompute s", "model s",
                "err", "faster (T/R)", "cost model", "runtime plan"]
        body = []
        for r in rows:
            ok = lambda c: "" if c not in r else (" ok" if r[c] else " NO")  # noqa: E731
            body.append([
                r["label"], str(r["context"]), _cell(mib(r["kv_bytes"]), "{:.1f}"), _cell(r["transfer_s"]),
                _cell(r.get("model_t_transfer_s")), _cell(r.get("err_transfer"), "{:+.0%}"),
                _cell(r["transfer_gbps"] * 8000 if r.get("transfer_gbps") else None, "{:.0f}"),
                _cell(r["recompute_s"]), _cell(r.get("model_t_recompute_s")), _cell(r.get("err_recompute"), "{:+.0%}"),
                f"{r['faster']} ({_cell(r.get('transfer_over_recompute'), '{:.2f}')})"
                + (" near tie" if r.get("near_tie") else ""),
                r["model_action"] + ok("model_correct"), r.get("runtime_action", "-") + ok("runtime_correct"),
            ])
        lines += ["Measured (real states, real transfers; netem rows are real tc rate limits; err = (model - "
                  "measured) / measured; T/R = measured transfer / recompute):", ""]
        lines += md_table(head, body) + [""]
        e3 = exp3_errors(rows)
        if e3["worst"]:
            a, v, what, label, ctx = e3["worst"]
            lines.append(f"- Worst prediction error at 512-4,096 tokens: **{v:+.0%}** ({what}, {label}, {ctx} tokens); "
                         f"{e3['within_25']}/{e3['of']} predictions within +-25%.")
        for col, name in (("model_correct", "cost model (runtime's bandwidth view)"),
                          ("probe_model_correct", "cost model with the fresh probe bandwidth"),
                          ("runtime_correct", "runtime's own plan")):
            c = e3["correct"][col]
            if c["of"]:
                lines.append(f"- {name}: faster option at {c['right']}/{c['of']} points, near ties (within 30%) "
                             f"included: {c['near_tie_right']}/{c['near_tie_of']} of those right.")
        lines.append("")
    net = doc.get("netem") or {}
    if net.get("error"):
        lines += [f"Real throttling: {net['error']}.", ""]
    modeled = doc.get("exp3_modeled") or []
    if modeled:
        ctxs = sorted({r["context"] for r in modeled})
        bws = sorted({r["bandwidth_gbps"] for r in modeled}, reverse=True)
        lines += [("**MODELED** (cost model only: measured prefill profile of the destination worker, "
                  "link = bandwidth + fixed latency; nothing transferred):"), ""]
        head = ["tokens", "crossover Gbit/s"] + [f"{bw:g} GB/s" for bw in bws]
        body = []
        for c in ctxs:
            rs = {r["bandwidth_gbps"]: r for r in modeled if r["context"] == c}
            any_r = next(iter(rs.values()))
            body.append([str(c), _cell(any_r["crossover_gbps"] * 8, "{:.3f}")] + [
                f"{rs[bw]['action'][:2]} {rs[bw]['t_transfer_s']:.3f}/{rs[bw]['t_recompute_s']:.3f}" for bw in bws])
        lines += md_table(head, body) + ["", "(tr/re = chosen action; cells: modeled transfer s / recompute s)", ""]
    return lines


def _memory_table(summary) -> list[str]:
    rows = [r for r in summary if r["exp"] == "exp2" and r["phase"] == "cold"]
    if not rows:
        return []
    systems = list(dict.fromkeys(r["system"] for r in rows))
    lines = [("Cold runs, per system and k: KV bytes by accounting (live caches at peak; for daskflow-kv the "
             "Dask-held blocks sampled on the workers) / sampled peak RSS growth of the workers, MiB:"), ""]
    body = []
    for k in sorted({r["k"] for r in rows}):
        cells = [str(k)]
        for s in systems:
            r = next((x for x in rows if x["k"] == k and x["system"] == s), None)
            cells.append("-" if r is None or not r["reps"] else
                         f"{_cell(mib(r['kv_accounted_bytes']), '{:.1f}')} / "
                         f"{_cell(mib(r['rss_peak_delta_bytes']), '{:.1f}')}")
        body.append(cells)
    return lines + md_table(["k"] + [LABELS.get(s, s) for s in systems], body) + [""]


def _exp6_lines(summary) -> list[str]:
    rows = [r for r in summary if r["exp"] == "exp6"]
    if not rows:
        return []
    lines = ["## Exp 6: multi-round workflows", ""]
    lines += grid(summary, "exp6", "wall_s", "Workflow wall time, s")
    lines += grid(summary, "exp6", "ttft_mean_s", "Mean TTFT from the workflow's start, s")
    lines += grid(summary, "exp6", "tokens_prefilled", "Prompt tokens prefilled", "{:.0f}", spread=False)
    body = [[r["workflow"], LABELS.get(r["system"], r["system"]),
             ", ".join(_cell(x, "{:.2f}") for x in (r.get("round_ttft_s") or [])) or r.get("invalid", "-")]
            for r in rows]
    lines += ["**Mean TTFT per round** (from the round's start, s; rounds in order):", ""]
    return lines + md_table(["workflow", "system", "per round"], body) + [""]


def _exp7_lines(summary) -> list[str]:
    rows = [r for r in summary if r["exp"] == "exp7"]
    if not rows:
        return []
    lines = ["## Exp 7: streams of workflows", "",
             "Streams: `uniform` (documents in turn), `zipf` (documents drawn from a Zipf law, s = 1.1), "
             "`zipf-budget` (the Zipf stream under a per-worker KV budget holding part of the working set; "
             "`local`'s engines retain the same bytes). Offered rate = workflows / arrival span; *saturated* = "
             "completes under 80% of it. Latency = arrival to completion. Hit rate = 1 - tokens prefilled / text "
             "replay's prompt tokens. Repeat prefill = doc-level prefill of a document the system had already "
             "prefilled in that stream (an eviction's regret, or a copy rebuilt instead of moved). Medians over "
             "repetitions; min-max in brackets.", ""]
    body = []
    for r in rows:
        body.append([r.get("stream", "-"), _cell(r.get("rate"), "{:g}"), LABELS.get(r["system"], r["system"]),
                     _cell(r.get("offered_per_min"), "{:.1f}"),
                     metric_cell(r, "completed_per_min", "{:.1f}") + _spread(r, "completed_per_min", "{:.1f}"),
                     metric_cell(r, "latency_p50_s", "{:.1f}"), metric_cell(r, "latency_p95_s", "{:.1f}"),
                     metric_cell(r, "ttft_mean_s", "{:.2f}"), _cell(r.get("tokens_prefilled"), "{:.0f}"),
                     _cell(r.get("hit_rate"), "{:.0%}"), _cell(r.get("repeat_prefill_tokens"), "{:.0f}"),
                     _cell(r.get("transfers"), "{:.0f}"), _cell(r.get("evictions"), "{:.0f}"),
                     _cell(r.get("failed"), "{:.0f}"), {True: "yes", False: "no", None: "-"}[r.get("agree")]])
    lines += md_table(["stream", "rate /min", "system", "offered /min", "completed /min", "p50 s", "p95 s",
                     "mean TTFT s", "tokens prefilled", "hit rate", "repeat prefill", "transfers", "evictions",
                     "failed", "agree"], body) + [""]
    return lines


def _spread(r: dict, f: str, fmt: str) -> str:
    lo, hi = r.get(f + "_min"), r.get(f + "_max")
    return "" if lo is None or hi is None or r.get("reps", 1) < 2 else f" [{fmt.format(lo)}-{fmt.format(hi)}]"


def markdown(doc: dict, summary: list[dict]) -> str:
    m, cfg = doc["machine"], doc["config"]
    model = doc.get("model", {})
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in (doc.get("timing") or {}).items())
    lines = [
        f"# daskflow-kv benchmark summary ({doc['tag']})", "",
        *([f"**{model['emulated']['label']}**: every step slept what the profile prices it at; the "
           "control plane, transfers and K/V bytes were real ([profile sources]"
           f"(../../daskflow_kv/model/profiles/{model['emulated']['profile']}.json))  "] if model.get("emulated") else []),
        f"Command: `{doc['command']}`  ", (f"Model: {model.get('model_id', cfg['model'])} ({model.get('dtype')}, "
        f"{model.get('bytes_per_token')} KV bytes/token, {model.get('max_positions')} positions)  "),
        (f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
         f"dask {m['dask']}, distributed {m['distributed']}; load average at start {m.get('load_avg_at_start')}  "),
        f"Provenance: {provenance.describe(doc)}  ",
        (f"Cluster: LocalCluster, {cfg['workers']} worker processes x 1 thread, TCP; total "
         f"{doc.get('total_s', 0):.0f} s ({timing or 'per experiment: -'})  "),
        (f"Repetitions per point: {cfg['reps']} (medians, spread min-max). Phases: {', '.join(cfg.get('phases', ['cold']))}. "
         f"Agents generate up to {cfg['max_new_tokens']} tokens, greedy."),
        "", "Systems:", "",
        *(f"- **{s}** ({LABELS.get(s, s)}): {BASELINE_NOTES.get(s, '')}" for s in cfg["systems"]),
        "",
        ("Definitions: TTFT = an agent's first generated token (the worker's wall clock) minus the workflow's "
         "start (the client's wall clock, same host), averaged over agents: queueing and any shared prefill "
         "included, the same for every system and path. shared_prefill_wall_s = from the workflow's start "
         "until the first copy of the shared context existed to resume from (0 when it was already cached; "
         "for text replay, which never holds it alone, the end of its first prompt prefill). A cold row with "
         "mean TTFT < shared_prefill_wall_s is refused (INVALID). Cold = every system's caches emptied first; "
         "warm = the shared context left cached by an earlier workflow (same prefix, other questions) run by "
         "the same system, where that system keeps it. Omega = wall - model compute of the busiest worker "
         "(the union of its requests' compute: batched ones overlap); a busiest compute above the wall is "
         "refused (INVALID). "
         "Every system's tokens are compared with text replay's; a mismatch voids its speed (MISMATCH)."),
        "",
    ]
    lines += _targets_lines(doc, summary)
    mism = sorted({(r["exp"], str(r[POINT_KEY[r["exp"]]]), r["system"], r["phase"]) for r in summary
                   if r.get("invalid") == "MISMATCH"})
    bad = sorted({(r["exp"], str(r[POINT_KEY[r["exp"]]]), r["system"], r["phase"]) for r in summary
                  if r.get("invalid") == "INVALID"})
    failed = sorted({(r["exp"], str(r[POINT_KEY[r["exp"]]]), r["system"], r["phase"]) for r in summary
                     if r.get("errors")})
    if failed:
        lines += ["**Failed runs** (see the JSON for errors): " + ", ".join(" ".join(f) for f in failed), ""]
    if bad:
        lines += ["**INVALID** (TTFT before the shared context was ready; not reported): "
                  + ", ".join(" ".join(f) for f in bad), ""]
    over = sorted({(r["exp"], str(r[POINT_KEY[r["exp"]]]), r["system"], r["phase"]) for r in summary
                   if r.get("overhead_invalid")})
    if over:
        lines += ["**INVALID Omega** (the busiest worker's compute exceeded the wall: batched requests were "
                  "summed, before the run counted their union; not reported): " + ", ".join(" ".join(f) for f in over),
                  ""]
    lines += ["**Output agreement:** " + ("every system matched text replay token for token at every point."
                                          if not mism else "MISMATCH at " + ", ".join(" ".join(f) for f in mism)), ""]
    if any(r["exp"] == "exp1" for r in summary):
        lines += ["## Exp 1: TTFT vs context length", ""]
        lines += grid(summary, "exp1", "ttft_mean_s", "Mean TTFT, s")
        lines += grid(summary, "exp1", "shared_prefill_wall_s", "Shared context ready (shared_prefill_wall_s), s",
                      spread=False)
        lines += grid(summary, "exp1", "wall_s", "Workflow wall time, s")
    if any(r["exp"] == "exp2" for r in summary):
        lines += ["## Exp 2: total workflow time vs agents k", ""]
        lines += grid(summary, "exp2", "wall_s", "Workflow wall time, s")
        lines += grid(summary, "exp2", "ttft_mean_s", "Mean TTFT, s")
        lines += grid(summary, "exp2", "tokens_prefilled", "Prompt tokens prefilled", "{:.0f}", spread=False)
    warm = [r for r in summary if r["system"] == SUBJECT and r["phase"] == "warm" and value(r, "engine_ttft_mean_s")]
    if warm:
        lines += ["**Warm TTFT against an in-process Engine resume of the same shapes** (daskflow-kv's branches "
                  "per worker, batched, over a prefix already in memory; first repetition):", ""]
        lines += md_table(["exp", "point", "daskflow-kv warm TTFT s", "Engine resume TTFT s", "ratio"],
                        [[r["exp"], str(r[POINT_KEY[r["exp"]]]), _cell(r["ttft_mean_s"]),
                          _cell(r["engine_ttft_mean_s"]), _cell(r["ttft_mean_s"] / r["engine_ttft_mean_s"], "{:.2f}x")]
                         for r in warm]) + [""]
    if doc.get("exp3") or doc.get("exp3_modeled"):
        lines += ["## Exp 3: transfer vs recompute", ""] + _exp3_lines(doc)
    if any(r["exp"] == "exp2" for r in summary):
        lines += ["## Exp 4: peak KV bytes vs branch factor", ""] + _memory_table(summary)
        lines += ["## Exp 5: throughput and framework overhead", ""]
        lines += grid(summary, "exp2", "throughput_tok_s", "Generated tokens / s", "{:.1f}", spread=False,
                      higher_better=True)
        lines += grid(summary, "exp2", "omega_s", "Omega (framework overhead), s", spread=False)
    lines += _exp6_lines(summary) + _exp7_lines(summary) + exp7_modeled.lines(doc)
    return "\n".join(lines) + "\n"
