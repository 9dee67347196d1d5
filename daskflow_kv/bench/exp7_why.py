"""Where exp 7's prefill work went, daskflow-kv against ``local`` at one point. Pure.

At saturation a stream's throughput is bounded by its busiest worker's work, and on this
model that is mostly prompt prefill. Every exp 7 run records the prompt tokens prefilled per
operation (``prefill_by_op``: ``materialize``, a context's copy made on a worker that had
none to start from; ``recompute``, a prefix rebuilt on a second worker instead of moved
there; ``resume``, the agents' own prompts) and per worker (``prefill_by_worker``).
``cost_terms`` takes the medians over repetitions; ``why`` names the term that separates the
two systems, in a sentence SUMMARY.md carries under a missed exp 7 target.
"""

from __future__ import annotations

from .common import median

REBUILD_SHARE = 0.25  # rebuilt copies above this share of daskflow-kv's prefill are the term to name
IMBALANCE = 0.10  # the busiest worker's share of the prefill this much above local's: the term


def cost_terms(runs: list[dict]) -> dict:
    """Medians over ``runs`` (one system at one point) of the terms behind its throughput."""
    ops = sorted({op for r in runs for op in (r.get("prefill_by_op") or {})})
    return {
        "tokens": median([r.get("tokens_prefilled") or 0 for r in runs]),
        "by_op": {op: median([(r.get("prefill_by_op") or {}).get(op, 0) for r in runs]) for op in ops},
        "busiest": median([max((r.get("prefill_by_worker") or {"-": 0}).values()) for r in runs]),
        "repeat": median([r.get("repeat_prefill_tokens") or 0 for r in runs]),
        "transfers": median([r.get("transfers") or 0 for r in runs]),
    }


def why(dkv_runs: list[dict], local_runs: list[dict]) -> str:
    """The busiest worker's prefill on each side, where the prefill went, and the term that
    separates the systems (rebuilt copies, imbalance, or something other than prefill)."""
    if not dkv_runs or not local_runs:
        return ""
    d, l = cost_terms(dkv_runs), cost_terms(local_runs)
    rebuilt = d["by_op"].get("recompute", 0.0)
    facts = (f"the busiest worker prefilled {d['busiest']:.0f} prompt tokens under daskflow-kv and "
             f"{l['busiest']:.0f} under local; daskflow-kv prefilled {d['tokens']:.0f} in all ({_ops(d)}; "
             f"{d['transfers']:.0f} transfers), local {l['tokens']:.0f} ({_ops(l)}; {l['repeat']:.0f} of them a "
             "document again). ")
    if d["tokens"] and rebuilt / d["tokens"] >= REBUILD_SHARE:
        return facts + (f"The term: daskflow-kv rebuilt prefixes on a second worker ({rebuilt:.0f} tokens, "
                        f"{rebuilt / d['tokens']:.0%} of its prefill) where a move costs 1-2 % of a rebuild: "
                        "placement prices a rebuild on a momentarily idle worker as free while the stream "
                        "keeps every worker busy.")
    if d["tokens"] and l["tokens"] and d["busiest"] / d["tokens"] >= l["busiest"] / l["tokens"] + IMBALANCE:
        return facts + "The term: imbalance - daskflow-kv's busiest worker carried more of its prefill than local's."
    return facts + "The term is not prefill: queueing and per-task overhead (see mean TTFT)."


def rebuild_reasons(decisions) -> dict:
    """Why the planner chose each rebuild (``Decision``s with action "recompute"): per reason
    and ``loaded`` flag, how many, the tokens they rebuilt and the median wait for the blocks
    on their source against the destination's own queue - so a run says which rule rebuilt."""
    out: dict[str, dict] = {}
    for d in decisions:
        if d.action != "recompute":
            continue
        row = out.setdefault(f"{d.reason} (loaded)" if d.loaded else d.reason,
                             {"n": 0, "tokens": 0, "src_ready_s": [], "dst_wait_s": []})
        row["n"] += 1
        row["tokens"] += d.missing_tokens
        row["src_ready_s"].append(d.src_ready)
        row["dst_wait_s"].append(d.dst_wait)
    for row in out.values():
        row["src_ready_s"], row["dst_wait_s"] = median(row["src_ready_s"]), median(row["dst_wait_s"])
    return out


def _ops(t: dict) -> str:
    return ", ".join(f"{op} {n:.0f}" for op, n in t["by_op"].items()) or "no breakdown recorded"
