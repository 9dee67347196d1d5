"""Result files of ``daskflow-kv bench``: JSON, CSVs, PNG plots and a markdown summary.

Medians over repetitions per (experiment, point, system). A system whose tokens differed
from text replay's at a point gets no speed there: its timing cells are blank and the
summary says MISMATCH.
"""

from __future__ import annotations

import math
from pathlib import Path

from .common import median, mib, write_csv, write_json
from .systems import LABELS

BASELINES = ("text", "hf", "local")
SUBJECT = "dkv"
SPEED_FIELDS = ("wall_s", "ttft_mean_s", "ttft_p50_s", "ttft_max_s", "throughput_tok_s", "busiest_compute_s",
                "omega_s", "omega_frac", "prefill_s", "decode_s", "shared_prefill_s")
MEDIAN_FIELDS = SPEED_FIELDS + ("tokens_prefilled", "kv_bytes_copied", "bytes_transferred", "kv_accounted_bytes",
                                "rss_peak_delta_bytes", "dask_kv_peak_bytes", "generated_tokens", "prompt_tokens",
                                "prefix_tokens")
POINT_KEY = {"exp1": "context", "exp2": "k"}


def summarize(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    order = list(dict.fromkeys(r["system"] for r in runs))  # systems in the order they were given
    for r in runs:
        groups.setdefault((r["exp"], r[POINT_KEY[r["exp"]]], r["system"]), []).append(r)
    out = []
    for (exp, point, system), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.index(kv[0][2]))):
        errors = [r["error"] for r in rs if r.get("error")]
        rs = [r for r in rs if not r.get("error")]
        if not rs:
            out.append({"exp": exp, POINT_KEY[exp]: point, "system": system, "reps": 0, "agree": None,
                        "errors": errors})
            continue
        agree = None if any(r["agree"] is None for r in rs) else all(r["agree"] for r in rs)
        row = {"exp": exp, POINT_KEY[exp]: point, "system": system, "reps": len(rs), "agree": agree,
               "agents": rs[0]["agents"]}
        for f in MEDIAN_FIELDS:
            row[f] = median([r.get(f) for r in rs])
        if agree is False:
            for f in SPEED_FIELDS:
                row[f] = None
        decisions: dict[str, int] = {}
        for r in rs:
            for a, n in (r.get("decisions") or {}).items():
                decisions[a] = decisions.get(a, 0) + n
        row["decisions"] = decisions
        if errors:
            row["errors"] = errors
        out.append(row)
    return out


def _cell(x, fmt="{:.3f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _ratio(base, subj):
    if base is None or subj is None or subj == 0 or any(isinstance(v, float) and math.isnan(v) for v in (base, subj)):
        return None
    return base / subj


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _point_tables(summary, exp: str, metric: str, title: str, unit_fmt="{:.3f}", higher_better=False,
                  ratios: bool = True) -> list[str]:
    key = POINT_KEY[exp]
    rows = [r for r in summary if r["exp"] == exp]
    if not rows:
        return []
    systems = list(dict.fromkeys(r["system"] for r in rows))
    points = sorted({r[key] for r in rows})
    by = {(r[key], r["system"]): r for r in rows}
    lines = [f"**{title}** (median; MISMATCH = outputs differ from text replay, not reported)", ""]
    head = [key] + [LABELS.get(s, s) for s in systems]
    body = []
    for p in points:
        cells = [str(p)]
        for s in systems:
            r = by.get((p, s))
            cells.append("-" if r is None else "MISMATCH" if r["agree"] is False else
                         "FAILED" if not r["reps"] else _cell(r.get(metric), unit_fmt))
        body.append(cells)
    lines += _table(head, body) + [""]
    if SUBJECT in systems and ratios:
        word = "daskflow-kv / baseline" if higher_better else "baseline / daskflow-kv"
        lines += [f"Ratio {word} for {metric} (>1 means daskflow-kv is better):", ""]
        head = [key] + [f"vs {LABELS.get(b, b)}" for b in systems if b != SUBJECT]
        body = []
        for p in points:
            subj = by.get((p, SUBJECT))
            cells = [str(p)]
            for b in systems:
                if b == SUBJECT:
                    continue
                base = by.get((p, b))
                if (subj is None or base is None or subj["agree"] is False or base["agree"] is False
                        or not subj["reps"] or not base["reps"]):
                    cells.append("-")
                    continue
                r = _ratio(subj[metric], base[metric]) if higher_better else _ratio(base[metric], subj[metric])
                cells.append(_cell(r, "{:.2f}x"))
            body.append(cells)
        lines += _table(head, body) + [""]
    return lines


def _memory_table(summary) -> list[str]:
    rows = [r for r in summary if r["exp"] == "exp2"]
    if not rows:
        return []
    systems = list(dict.fromkeys(r["system"] for r in rows))
    lines = [("Per system and k: KV bytes by accounting (live caches at peak; for daskflow-kv the Dask-held "
             "blocks sampled on the workers) / sampled peak RSS growth of the workers, MiB:"), ""]
    head = ["k"] + [LABELS.get(s, s) for s in systems]
    body = []
    for k in sorted({r["k"] for r in rows}):
        cells = [str(k)]
        for s in systems:
            r = next((x for x in rows if x["k"] == k and x["system"] == s), None)
            cells.append("-" if r is None or not r["reps"] else
                         f"{_cell(mib(r['kv_accounted_bytes']), '{:.1f}')} / {_cell(mib(r['rss_peak_delta_bytes']), '{:.1f}')}")
        body.append(cells)
    return lines + _table(head, body) + [""]


def _exp3_lines(doc) -> list[str]:
    rows = doc.get("exp3") or []
    lines = []
    if rows:
        head = ["link", "tokens", "KV MiB", "transfer s (log)", "transfer Mbit/s", "recompute s", "faster",
                "model bw Gbit/s", "cost model", "ok", "model w/ probe bw", "ok", "runtime plan", "ok"]
        body = []
        for r in rows:
            body.append([
                r["label"], str(r["context"]), _cell(mib(r["kv_bytes"]), "{:.2f}"), _cell(r["transfer_s"]),
                _cell(r["transfer_gbps"] * 8000 if r.get("transfer_gbps") else None, "{:.0f}"),
                _cell(r["recompute_s"]), r["faster"] + (" (near tie)" if r.get("near_tie") else ""),
                _cell(r.get("model_bandwidth_gbps", math.nan) * 8, "{:.2f}"), r["model_action"],
                "yes" if r.get("model_correct") else "NO", r.get("probe_model_action", "-"),
                "-" if "probe_model_correct" not in r else ("yes" if r["probe_model_correct"] else "NO"),
                r.get("runtime_action", "-"),
                "-" if "runtime_correct" not in r else ("yes" if r["runtime_correct"] else "NO"),
            ])
        lines += ["Measured (real states, real transfers; netem rows are real tc rate limits):", ""]
        lines += _table(head, body) + [""]
        decided = [r for r in rows if not r.get("near_tie")]
        for col, name in (("model_correct", "cost model (runtime's bandwidth view)"),
                          ("probe_model_correct", "cost model with the fresh probe bandwidth"),
                          ("runtime_correct", "runtime's own plan")):
            got = [r[col] for r in decided if col in r]
            if got:
                lines.append(f"- {name}: picked the faster option at {sum(got)}/{len(got)} points "
                             f"(near ties within 15% excluded: {len(rows) - len(decided)})")
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
        lines += _table(head, body) + ["", "(tr/re = chosen action; cells: modeled transfer s / recompute s)", ""]
    return lines


def markdown(doc: dict, summary: list[dict]) -> str:
    m, cfg = doc["machine"], doc["config"]
    model = doc.get("model", {})
    lines = [
        f"# daskflow-kv benchmark summary ({doc['tag']})", "",
        f"Command: `{doc['command']}`  ", (f"Model: {model.get('model_id', cfg['model'])} ({model.get('dtype')}, "
        f"{model.get('bytes_per_token')} KV bytes/token, {model.get('max_positions')} positions)  "),
        (f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
        f"dask {m['dask']}, distributed {m['distributed']}; load average at start {m.get('load_avg_at_start')}  "),
        f"Cluster: LocalCluster, {cfg['workers']} worker processes x 1 thread, TCP; total {doc.get('total_s', 0):.0f} s  ",
        f"Repetitions per point: {cfg['reps']} (medians). Agents generate up to {cfg['max_new_tokens']} tokens, greedy.",
        "",
        "Systems: " + "; ".join(f"**{s}** = {LABELS.get(s, s)}" for s in cfg["systems"]) + ".",
        "",
        ("Definitions: TTFT = time from the workflow's start to an agent's first generated token (queueing "
        "included), averaged over agents. Omega = wall time - model compute of the busiest worker "
        "(scheduling, transfers, serialization, idle). Every system's tokens are compared with text replay's; "
        "a mismatch voids its speed at that point."),
        "",
    ]
    mism = sorted({(r["exp"], r[POINT_KEY[r["exp"]]], r["system"]) for r in summary if r["agree"] is False})
    failed = sorted({(r["exp"], r[POINT_KEY[r["exp"]]], r["system"]) for r in summary if r.get("errors")})
    if failed:
        lines += ["**Failed runs** (see the JSON for errors): " + ", ".join(f"{e} {p} {s}" for e, p, s in failed), ""]
    lines += ["**Output agreement:** " + ("every system matched text replay token for token at every point."
                                          if not mism else "MISMATCH at " + ", ".join(f"{e} {p} {s}" for e, p, s in mism)),
              ""]
    if any(r["exp"] == "exp1" for r in summary):
        lines += ["## Exp 1: TTFT vs context length", ""]
        lines += _point_tables(summary, "exp1", "ttft_mean_s", "Mean TTFT, s")
        lines += _point_tables(summary, "exp1", "wall_s", "Workflow wall time, s")
    if any(r["exp"] == "exp2" for r in summary):
        lines += ["## Exp 2: total workflow time vs agents k", ""]
        lines += _point_tables(summary, "exp2", "wall_s", "Workflow wall time, s")
        lines += _point_tables(summary, "exp2", "tokens_prefilled", "Prompt tokens prefilled", "{:.0f}")
    if doc.get("exp3") or doc.get("exp3_modeled"):
        lines += ["## Exp 3: transfer vs recompute", ""] + _exp3_lines(doc)
    if any(r["exp"] == "exp2" for r in summary):
        lines += ["## Exp 4: peak KV bytes vs branch factor", ""] + _memory_table(summary)
        lines += _point_tables(summary, "exp2", "kv_accounted_bytes", "KV bytes by accounting", "{:.0f}")
        lines += ["## Exp 5: throughput and framework overhead", ""]
        lines += _point_tables(summary, "exp2", "throughput_tok_s", "Generated tokens / s", "{:.1f}",
                               higher_better=True)
        lines += _point_tables(summary, "exp2", "omega_s", "Omega (framework overhead), s", ratios=False)
        lines += _point_tables(summary, "exp2", "omega_frac", "Omega as a fraction of wall time", "{:.2f}",
                               ratios=False)
    return "\n".join(lines) + "\n"


def plot(doc: dict, summary: list[dict], out_dir: Path, tag: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []

    def lines_plot(exp, metric, xlabel, ylabel, name, logx=False):
        key = POINT_KEY[exp]
        rows = [r for r in summary if r["exp"] == exp and r.get(metric) is not None]
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r[key], r[metric]) for r in rows if r["system"] == s)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=LABELS.get(s, s))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{doc.get('model', {}).get('name', '')}: {ylabel} vs {xlabel}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"bench_{tag}_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    lines_plot("exp1", "ttft_mean_s", "context tokens", "mean TTFT (s)", "exp1_ttft", logx=True)
    lines_plot("exp2", "wall_s", "agents k", "workflow wall time (s)", "exp2_wall", logx=True)
    lines_plot("exp2", "kv_accounted_bytes", "agents k", "peak KV bytes (accounted)", "exp4_kv_bytes", logx=True)
    lines_plot("exp2", "rss_peak_delta_bytes", "agents k", "peak worker RSS growth (bytes)", "exp4_rss", logx=True)
    lines_plot("exp2", "throughput_tok_s", "agents k", "generated tokens/s", "exp5_throughput", logx=True)
    lines_plot("exp2", "omega_s", "agents k", "Omega = wall - busiest compute (s)", "exp5_omega", logx=True)

    e3 = doc.get("exp3") or []
    if e3:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label in dict.fromkeys(r["label"] for r in e3):
            rs = sorted((r for r in e3 if r["label"] == label), key=lambda r: r["context"])
            ax.plot([r["context"] for r in rs], [r["transfer_s"] for r in rs], marker="o", label=f"transfer, {label}")
        rs = sorted((r for r in e3 if r["label"] == "loopback"), key=lambda r: r["context"]) or e3
        ax.plot([r["context"] for r in rs], [r["recompute_s"] for r in rs], "k--", marker="s", label="recompute (prefill)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens moved or recomputed")
        ax.set_ylabel("seconds (measured)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("Exp 3: transfer vs recompute (measured)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"bench_{tag}_exp3.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def write_all(doc: dict, out_dir: Path, tag: str, plots: bool = True, summary_path: Path | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(doc.get("runs", []))
    doc["summary"] = summary
    files = [write_json(out_dir / f"bench_{tag}.json", doc)]
    if doc.get("runs"):
        files.append(write_csv(out_dir / f"bench_{tag}_runs.csv", doc["runs"]))
        files.append(write_csv(out_dir / f"bench_{tag}_summary.csv", summary))
    if doc.get("exp3"):
        files.append(write_csv(out_dir / f"bench_{tag}_exp3.csv", doc["exp3"]))
    if doc.get("exp3_modeled"):
        files.append(write_csv(out_dir / f"bench_{tag}_exp3_modeled.csv", doc["exp3_modeled"]))
    if plots:
        files += plot(doc, summary, out_dir, tag)
    path = summary_path or out_dir / f"SUMMARY_{tag}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(doc, summary))
    files.append(path)
    return files
