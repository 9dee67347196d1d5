"""docs/reliability.md's table, generated from the scenario JSONs in benchmarks/results/.

One row per fault scenario: the load it held, the faults injected, workflows lost, wrong or
hung, the KV blocks recomputed, and the latency cost. A scenario whose JSON does not exist
is listed as not run, so the table never claims more than the results directory holds.

    python -m daskflow_kv.bench.reliability_table            # rewrites docs/reliability.md's block
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .common import RESULTS_DIR

MARKERS = ("<!-- reliability:start -->", "<!-- reliability:end -->")
DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
# scenario -> (its JSON in benchmarks/results, what it is)
SCENARIOS = {
    "chaos during a stream": ("chaos.json", "benchmarks/chaos.py"),
    "chaos under a KV budget far below what is in flight": ("chaos_budget_256k_kills_redo_r1.json",
                                                            "benchmarks/chaos.py"),
    "soak": ("soak.json", "benchmarks/soak.py"),
    "a client lost": ("client_lost.json", "benchmarks/client_lost.py"),
    "the scheduler lost": ("scheduler_lost.json", "benchmarks/scheduler_lost.py"),
    "memory pressure": ("memory_pressure.json", "benchmarks/memory_pressure.py"),
}


def _chaos_row(d: dict) -> list[str]:
    cfg = d["config"]
    budget = d.get("settings", {}).get("kv-budget")
    load = (f"2 clients x {cfg['workflows']} workflows ({cfg['concurrency']} at a time each), "
            f"{d['workers']} workers, {d['model']}" + (f", KV budget {budget} per worker" if budget else ""))
    faults = f"{len(d['kills'])} SIGKILLs, one every {cfg['kill_every'][0]:g}-{cfg['kill_every'][1]:g} s"
    before, after = d.get("latency_median_s_before_first_kill"), d.get("latency_median_s_after_first_kill")
    cost = (f"median {before:.2f} s -> {after:.2f} s" if before and after
            else f"median {after:.2f} s (kills from the start)" if after else "-")
    return [load, faults, f"{d['lost']} / {d['wrong']} / {d['hung']} of {d['workflows']}",
            f"{d['counters_delta'].get('lineage_recomputes', 0)} blocks", cost]


def _client_lost_row(d: dict) -> list[str]:
    before, after = d["victim_before"], d["victim_after"]
    cleaned = d["cleaned_within_s"]
    return [f"a client holding {before['live_states']} live states and {before['blocks_still_wanted']} pinned "
            f"blocks; another client streaming {d['survivor_workflows']} workflows",
            f"the first client's process SIGKILLed {d['kill_after_s']:g} s into the stream",
            f"0 / {d['survivor_workflows'] - d['survivor_agree']} / 0 of {d['survivor_workflows']} (survivor)",
            "-",
            (f"victim cleaned up in {cleaned:.1f} s: sessions {after['sessions']}, live states "
             f"{after['live_states']}, pinned blocks {after['blocks_still_wanted']}") if cleaned is not None
            else "victim NOT cleaned up"]


def _memory_pressure_row(d: dict) -> list[str]:
    return [f"1 client, {d['workflows']} workflows over {d['docs']} documents ({d['context']} tokens), "
            f"{d['workers']} workers, {d['model']}, no KV budget",
            f"memory_limit {d['memory_limit'] / 2**20:.0f} MiB per worker: the working set (model + KV) "
            f"{d['working_set_over_limit']:.2f}x the limit",
            f"{d['lost']} / {d['wrong']} / {int(d['hung'])} of {d['workflows']}",
            f"{d['kv_counters'].get('lineage_recomputes', 0)} blocks",
            f"peak {d['peak_spilled_disk_bytes'] / 2**20:.0f} MiB spilled to disk, {d['pause_episodes']} pauses, "
            f"peak RSS {d['peak_rss_over_limit']:.2f}x the limit; stream {d['wall_s']:.0f} s"]


def _soak_row(d: dict) -> list[str]:
    cfg, g = d["config"], d["growth_after_warmup"]
    # Memory, and what the scheduler keeps per workflow; gauges that hover near zero (store
    # writes in flight, leases) swing by whole units and say nothing as a percentage.
    # Older runs hosted the scheduler in the clients' process: one RSS for both.
    apart = not d.get("scheduler_in_process", True)
    rss = (("scheduler RSS", "scheduler_rss"), ("clients RSS", "client_rss")) if apart else \
        (("scheduler + clients RSS", "scheduler_rss"),)
    shown = [(name, g.get(key)) for name, key in (*rss, ("workers RSS", "workers_rss"), ("tasks", "tasks"),
                                                  ("catalog blocks", "catalog_blocks"),
                                                  ("catalog states", "catalog_states")) if g.get(key) is not None]
    left = d["keys_left_after_clients_closed"]
    return [f"{cfg['clients']} clients x {cfg['concurrency']} in flight for {d['wall_s'] / 60:.0f} min: {d['workflows']} workflows "
            f"({d['workflows_per_min']:.0f}/min), KV budget {d['kv_budget_bytes'] / 2**10:.0f} KiB per worker "
            f"({d['evictions']} evictions), a persistent store, {d['workers']} workers, {d['model']}",
            "none (load only)",
            f"{d['lost']} / {d['wrong']} / {d['hung_threads']} of {d['workflows']}",
            "-",
            (f"growth from minute {cfg['warmup_minutes']:g} to the end: "
             + ", ".join(f"{name} {v:+.1%}" for name, v in shown) + "; " if shown else "")
            + f"after the clients closed: {left['wanted_by_no_one']} KV keys wanted by no one, "
            f"{left['cache']} kept by the cache"]


def _scheduler_lost_row(d: dict) -> list[str]:
    failures = [*d["in_flight_at_kill"], *d["next_calls"].values()]
    slowest = max((f["after_kill_s"] for f in failures), default=0.0)
    named = sum(1 for f in failures if f.get("names_scheduler"))
    return [f"1 client streaming {d['workflows']} workflows over {d['docs']} documents "
            f"({d['context']} tokens), {d['workers']} workers, {d['model']}, a persistent store",
            f"the scheduler's process SIGKILLed after {d['finished_before_kill']} workflows; a new cluster "
            f"over the same store resumes",
            f"{d['lost']} / {d['wrong']} / {int(d['hung'])} of {d['workflows']}",
            f"{d['stored_tokens_prefilled_again']} stored context tokens prefilled again "
            f"({d['context_tokens_from_store']} read from the store)",
            f"{len(failures)} calls failed within {slowest:.2f} s of the kill, {named} naming the scheduler"]


def _command(d: dict, script: str) -> str:
    """The run's command, with the Dask settings it ran under set as it set them (environment)."""
    env = [f"DASK_DASKFLOW_KV__{k.upper().replace('-', '_').replace('.', '__')}={v}"
           for k, v in d.get("settings", {}).items() if v is not None]
    return " ".join([*env, d.get("command", script)])


# a scenario JSON's name starts with its scenario's kind -> how that kind's row reads
ROWS = {"chaos": _chaos_row, "client_lost": _client_lost_row, "scheduler_lost": _scheduler_lost_row,
        "soak": _soak_row, "memory_pressure": _memory_pressure_row}


def render(results: Path = RESULTS_DIR) -> str:
    lines = ["| scenario | load held | faults injected | lost / wrong / hung | KV recomputed | latency | source |",
             "|---|---|---|---|---|---|---|"]
    for name, (file, script) in SCENARIOS.items():
        path = results / file
        if not path.is_file():
            lines.append(f"| {name} | not run | | | | | |")
            continue
        d = json.loads(path.read_text())
        row = next((f for stem, f in ROWS.items() if file.startswith(stem)), None)
        cells = row(d) if row else ["see JSON"] * 5
        source = f"`{_command(d, script)}` → [{file}](../benchmarks/results/{file})"  # a link: the doc cites it
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {source} |")
    return "\n".join(lines)


def rewrite(doc: Path = DOC, results: Path = RESULTS_DIR) -> bool:
    """Put the rendering between the markers of ``doc``. -> whether it changed."""
    text = doc.read_text()
    start, end = (re.escape(m) for m in MARKERS)
    new = re.sub(rf"{start}.*?{end}", lambda _: f"{MARKERS[0]}\n{render(results)}\n{MARKERS[1]}", text,
                 flags=re.DOTALL)
    if new != text:
        doc.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = rewrite()
    print(f"{DOC}: {'rewritten' if changed else 'already current'}")
    sys.exit(0)
