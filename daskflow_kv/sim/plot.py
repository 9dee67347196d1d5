"""The grid's figure: daskflow-kv / ``local`` throughput against workers, one line a stream.

Written next to the result JSON (``<out>.png``) when matplotlib is installed; every figure on
it is MODELED and says so.
"""

from __future__ import annotations

from pathlib import Path


def plot_ratios(result: dict, path: str | Path) -> Path | None:
    """``result["ratios"]`` as lines over workers (log scale); None without matplotlib or ratios."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result.get("ratios") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for stream in sorted({r["stream"] for r in rows}):
        pts = sorted((r["workers"], r["throughput_ratio"], r.get("throughput_ratio_min", r["throughput_ratio"]),
                      r.get("throughput_ratio_max", r["throughput_ratio"])) for r in rows if r["stream"] == stream)
        # several draws a point: the median, with the draws' range as its bar
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                    marker="o", capsize=3, label=stream)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")  # the target at 32 workers, Zipf under a budget
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("throughput, daskflow-kv / local")
    ax.set_title("MODELED (daskflow_kv/sim): " + result.get("profile", {}).get("name", ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
