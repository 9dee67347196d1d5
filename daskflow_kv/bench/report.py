"""Result files of ``daskflow-kv bench``: JSON, CSVs, PNG plots and the markdown summary.

The numbers are summarized in ``summary`` and written as markdown by ``report_md``; this
module writes the files. Every file names the run's tag: bench_<tag>.json (everything),
bench_<tag>_runs.csv, bench_<tag>_summary.csv, bench_<tag>_exp3.csv, plots, SUMMARY and
bench_<tag>_readme.md (the full results block of benchmarks/README.md, from the same rows).
"""

from __future__ import annotations

from pathlib import Path

from .common import write_csv, write_json
from .readme_blocks import readme_table
from .report_md import markdown
from .summary import POINT_KEY, summarize, targets
from .systems import LABELS


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
        for s, ph in dict.fromkeys((r["system"], r["phase"]) for r in rows):
            pts = sorted((r[key], r[metric]) for r in rows if r["system"] == s and r["phase"] == ph)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o" if ph == "cold" else "x",
                    linestyle="-" if ph == "cold" else "--", label=f"{LABELS.get(s, s)} ({ph})")
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
    lines_plot("exp7", "completed_per_min", "arrival rate (workflows/min)", "completed workflows/min",
               "exp7_throughput", logx=True)
    lines_plot("exp7", "latency_p95_s", "arrival rate (workflows/min)", "p95 workflow latency (s)", "exp7_p95",
               logx=True)

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


def _simulate_exp7(doc: dict, path: Path, simulate) -> None:
    """Each exp 7 row beside its simulation (``simulate(path)``: ``sim.beside.simulate``),
    read from the JSON just written, kept in it."""
    from .common import log
    from .exp7_modeled import line

    try:
        doc["exp7_modeled"] = simulate(path)
    except Exception as e:  # noqa: BLE001 -- a diagnostic: whatever stops it, the run's files are written
        doc["exp7_modeled_error"] = " ".join(f"{type(e).__name__}: {e}".split())
        log(f"exp7 not simulated: {doc['exp7_modeled_error']}")
    for r in (doc.get("exp7_modeled") or {}).get("rows", ()):
        log(line(r))
    write_json(path, doc)


def write_all(doc: dict, out_dir: Path, tag: str, plots: bool = True, summary_path: Path | None = None,
              simulate_exp7=None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(doc.get("runs", []))
    doc["summary"] = summary
    doc["targets"] = targets(doc, summary)
    files = [write_json(out_dir / f"bench_{tag}.json", doc)]
    if simulate_exp7 is not None and any(r.get("exp") == "exp7" for r in doc.get("runs", [])):
        _simulate_exp7(doc, files[0], simulate_exp7)
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
    table = out_dir / f"bench_{tag}_readme.md"
    table.write_text(readme_table(doc, summary))
    files.append(table)
    return files
