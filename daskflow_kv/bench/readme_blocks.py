"""The bench blocks of the READMEs: the full results table and the headline table.

Each block sits between its own pair of markers in a markdown file: the full results
(benchmarks/README.md) and a short headline (the top-level README). ``daskflow-kv bench
--readme README.md`` rewrites every block of README.md and of benchmarks/README.md beside
it from the run it has just made; ``python -m daskflow_kv.bench.readme_blocks RUN.json
--readme README.md`` renders the same blocks from a saved run without measuring again.
Every figure comes from the run's summary rows (``summary.summarize``), nothing modeled.
The headline names the commit its run measured and every later change to the measured code
it does not include (``measured_code``), read from git when the block is rendered.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from .. import validation
from ..errors import InvalidInputError
from . import measured_code
from .common import summary_file
from .report_md import exp_points, find_row, md_table, metric_cell
from .summary import POINT_KEY, SUBJECT, best_baseline, exp3_errors, gain, summarize, targets, upgrade
from .systems import LABELS

# The generated blocks a markdown file may hold, each between its own pair of markers: the full
# results table (its home: benchmarks/README.md) and the headline table (the top-level README).
RESULTS_MARKERS = ("<!-- bench:results:start -->", "<!-- bench:results:end -->")
HEADLINE_MARKERS = ("<!-- bench:headline:start -->", "<!-- bench:headline:end -->")
BLOCK_MARKERS = (RESULTS_MARKERS, HEADLINE_MARKERS)
RESULTS_HOME = Path("benchmarks") / "README.md"  # beside the README that --readme names


def blocks_in(text: str) -> list[tuple[str, str]]:
    """The marker pairs of the bench blocks ``text`` holds: each marker alone on its line, in
    order (a marker quoted inside a sentence, as docs do, is not one)."""
    return [pair for pair in BLOCK_MARKERS if _block_pattern(pair).search(text)]


def _block_pattern(markers: tuple[str, str]) -> re.Pattern:
    start, end = (re.escape(m) for m in markers)
    return re.compile(rf"^{start}[ \t]*$.*?^{end}[ \t]*$", re.MULTILINE | re.DOTALL)


def readme_files(readme) -> list[Path]:
    """The files ``--readme README`` rewrites: README and, when it exists, benchmarks/README.md
    beside it; refused (one line, before any run) if none of them holds a bench block."""
    readme = Path(readme)
    home = readme.parent / RESULTS_HOME
    files = [readme] + ([home] if home.is_file() and home.resolve() != readme.resolve() else [])
    files = [f for f in files if f.is_file() and blocks_in(f.read_text())]
    if not files:
        raise InvalidInputError(f"--readme {str(readme)!r}: neither it nor {str(home)!r} has a "
                                f"{RESULTS_MARKERS[0]} or {HEADLINE_MARKERS[0]} block")
    for f in files:
        validation.writable_file("--readme", f)
    return files


def update_readmes(readme, doc: dict, summary: list[dict], json_path, summary_path, only=None) -> list[str]:
    """Rewrite every bench block of ``readme_files(readme)`` from this run; one line per file.

    Links in a block (the run's JSON, its SUMMARY) are made relative to the file's folder, so
    one run renders correctly into README.md and into benchmarks/README.md. ``only``: the
    markers of the one kind of block to rewrite (a run of some experiments only renders the
    headline and leaves the full results of the run that has them)."""
    done = []
    for path in readme_files(readme):
        text = path.read_text()
        found = [pair for pair in blocks_in(text) if only is None or pair == only]
        if not found:
            continue
        for pair in found:
            block = (readme_table(doc, summary, _relative(summary_path, path)) if pair == RESULTS_MARKERS
                     else headline_table(doc, summary, _relative(json_path, path),
                                         measured_code.not_included(doc, json_path)))
            text = _replace_block(text, pair, block)
        path.write_text(text)
        done.append(f"{path}: {', '.join(start for start, _ in found)} rewritten")
    return done


def _replace_block(text: str, markers: tuple[str, str], block: str) -> str:
    start, end = markers
    return _block_pattern(markers).sub(lambda _: f"{start}\n{block.rstrip()}\n{end}", text, count=1)


def _relative(target, into: Path) -> str:
    return Path(os.path.relpath(Path(target).resolve(), into.resolve().parent)).as_posix()


_VERDICT = {True: "met", False: "**missed**", None: "not measured"}


def _agreement(summary: list[dict]) -> str:
    refused = [r for r in summary if r.get("invalid")]
    if not refused:
        return "Every system's tokens matched text replay's at every point."
    return ("Refused (outputs differed or TTFT broke its invariant): "
            + ", ".join(f"{r['exp']} {r[POINT_KEY[r['exp']]]} {r['system']} {r['phase']}" for r in refused) + ".")


def _exp7_tops(summary: list[dict]) -> list[tuple]:
    """(point, label) of each exp7 stream kind at its highest offered rate."""
    top: dict[str, tuple] = {}
    for r in summary:
        if r["exp"] == "exp7":
            kind, rate = r.get("stream", "uniform"), r.get("rate", r["point"])  # (upgraded: see summary.upgrade)
            if kind not in top or rate > top[kind][0]:
                top[kind] = (rate, r["point"])
    out = []
    for kind, (rate, point) in top.items():
        label = f"at {rate:g}/min offered" if not isinstance(point, str) else f"{kind} stream at {rate:g}/min offered"
        out.append((point, label))
    return out


def readme_table(doc: dict, summary: list[dict], summary_link: str = "benchmarks/results/SUMMARY.md") -> str:
    """The full results block (benchmarks/README.md): every figure from this run's summary,
    nothing modeled. ``summary_link``: the run's SUMMARY, relative to where the block goes."""
    summary = upgrade(summary)
    systems = [s for s in ("text", "hf", "local", "dkv") if any(r["system"] == s for r in summary)]
    head = ["experiment"] + [LABELS.get(s, s).split(" (")[0] for s in systems] + ["daskflow-kv vs best baseline"]
    body = []

    def add(label, exp, point, metric, fmt, phases=("cold", "warm"), higher_better=False):
        phases = [p for p in phases if any(r["exp"] == exp and r["phase"] == p for r in summary)]
        for ph in phases:
            cells = [f"{label} ({ph})" if len(phases) > 1 or ph != "cold" else label]
            for s in systems:
                r = find_row(summary, exp, point, s, ph) or (find_row(summary, exp, point, s, "cold")
                                                          if s == "text" and ph == "warm" else None)
                cells.append(metric_cell(r, metric, fmt))
            g, name = gain(summary, exp, point, ph, metric, higher_better)
            cells.append("-" if g is None else f"**{g:.2f}x** (vs {name})")
            body.append(cells)

    cfg = doc["config"]
    for ctx in exp_points(summary, "exp1"):
        add(f"mean TTFT, {cfg['agents']} agents, {ctx}-token context, s", "exp1", ctx, "ttft_mean_s", "{:.2f}")
    for k in exp_points(summary, "exp2"):
        add(f"wall, {k} agent{'s' if k != 1 else ''}, {cfg['exp2_context']}-token context, s", "exp2", k, "wall_s", "{:.2f}")
    for wf in exp_points(summary, "exp6"):
        add(f"wall, {wf} (multi-round), s", "exp6", wf, "wall_s", "{:.2f}", ("cold",))
    for point, label in _exp7_tops(summary):
        add(f"completed workflows/min {label}", "exp7", point, "completed_per_min", "{:.1f}", ("stream",),
            higher_better=True)
    m, model = doc["machine"], doc.get("model", {})
    lines = [f"Measured by `{doc['command']}` ({doc.get('total_s', 0) / 60:.0f} min, {m.get('time_utc', '')}): "
             f"{model.get('model_id', cfg['model'])} {model.get('dtype', '')}, a local Dask cluster of "
             f"{cfg['workers']} worker processes on {m['cpu']} ({m['cores']} cores), every system side by side in "
             f"one invocation on the same prompts; medians of {cfg['reps']} repetitions (spread in the summary; "
             "exp 7: one stream of workflows per rate). TTFT runs from the workflow's start to the agent's first "
             "token, shared prefill included, for every system. Cold: all caches empty; warm: the shared context "
             "left cached by an earlier workflow (text replay has no cache: its warm cells repeat its cold run). "
             "Ratios are against the best baseline at each point.", ""]
    lines += md_table(head, body)
    lines += ["", _agreement(summary)]
    e3 = exp3_errors(doc.get("exp3") or [])
    if e3["worst"]:
        c = e3["correct"]["runtime_correct"]
        lines += ["", f"Transfer vs recompute (exp 3, loopback and tc-throttled links, near-tie rates included): the "
                      f"runtime's plan picked the faster option at {c['right']}/{c['of']} points "
                      f"({c['near_tie_right']}/{c['near_tie_of']} near ties); {e3['within_25']}/{e3['of']} cost-model "
                      f"predictions within +-25%, worst {e3['worst'][1]:+.0%}."]
    ts = doc.get("targets") or targets(doc, summary)
    lines += ["", "Targets: " + "; ".join(f"{t['target']}: {_VERDICT[t['ok']]} ({t['detail']})" for t in ts) + "."]
    lines += ["", "All tables, the spread, memory (exp 4), overhead (exp 5) and plots: "
                  f"[{summary_link}]({summary_link})."]
    return "\n".join(lines) + "\n"


def _host(machine: dict) -> str:
    """The host a run measured on: its CPU model and cores. Ratios are read within one run,
    and a headline re-made on another CPU moves with it (decode steps above all)."""
    cpu = machine.get("cpu")
    return f"{cpu} ({machine['cores']} cores)" if cpu else f"{machine['cores']} cores"


def code_line(code: dict | None) -> str:
    """The code a headline's run measured and what it does not include
    (``measured_code.not_included``); empty when not given."""
    if code is None:
        return ""
    commit, later, dirty = code["commit"], code["later"], code["uncommitted"]
    if commit is None:
        return f"The code it measured is not known: {code['how']}."
    text = (f"Measured at commit `{commit[:7]}`" if code["how"] == "recorded" else
            f"Its JSON records no commit; it came into the repository with `{commit[:7]}`, so it measured code "
            "no newer than that")
    if dirty:
        text += f", with uncommitted changes to {', '.join(f'`{f}`' for f in dirty)}"
    if later is None:
        return text + f"; `{commit[:7]}` is not an ancestor of this checkout: later changes not known."
    if not later:
        return text + "; no later change to the measured code (daskflow_kv/ and plugins/, less what only reads " \
                      "results)."
    return (text + f". Later changes to the measured code (daskflow_kv/ and plugins/, less what only reads "
            f"results) not included ({len(later)}): " + "; ".join(f"`{h}` ({s})" for h, s in later) + ".")


def headline_table(doc: dict, summary: list[dict], json_link: str = "benchmarks/results/bench_full.json",
                   code: dict | None = None) -> str:
    """The top-level README's headline: mean TTFT cold and warm at the shortest and longest
    context and the stream's throughput, each against the best baseline at that point; then
    agreement and the targets. Every figure from this run (``json_link``: its JSON); ``code``:
    the code it measured and what it does not include (``code_line``)."""
    summary = upgrade(summary)
    cfg, m, model = doc["config"], doc["machine"], doc.get("model", {})
    body, named = [], {}  # the table's rows; the baselines it names (in order)

    def add(label, exp, point, phase, metric, fmt, higher_better=False):
        name, base = best_baseline(summary, exp, point, phase, metric, higher_better)
        if base is not None:
            named[name] = LABELS.get(name, name)
        g, _ = gain(summary, exp, point, phase, metric, higher_better)
        body.append([label, "-" if base is None else f"{fmt.format(base)} ({name})",
                     metric_cell(find_row(summary, exp, point, SUBJECT, phase), metric, fmt),
                     "-" if g is None else f"**{g:.2f}x**"])

    contexts = exp_points(summary, "exp1")
    for ph in ("cold", "warm"):
        for ctx in dict.fromkeys(contexts[:1] + contexts[-1:]):
            if find_row(summary, "exp1", ctx, SUBJECT, ph):
                add(f"mean TTFT, {cfg['agents']} agents, {ctx}-token context, s ({ph})", "exp1", ctx, ph,
                    "ttft_mean_s", "{:.2f}")
    for point, label in _exp7_tops(summary):
        add(f"completed workflows/min {label} (stream)", "exp7", point, "stream", "completed_per_min", "{:.1f}",
            higher_better=True)
    lines = [f"From `{doc['command']}` ({m.get('time_utc', '')[:10]}): {model.get('model_id', cfg['model'])} "
             f"{model.get('dtype', '')}, {cfg['workers']} Dask worker processes on {_host(m)}, medians of "
             f"{cfg['reps']}; every figure is in [{json_link}]({json_link}). TTFT runs from the workflow's start "
             "(shared prefill included); cold: caches empty, warm: the shared context cached by an earlier "
             "workflow. The best baseline is the best of the baselines at each point"
             + (" (" + "; ".join(f"{n}: {label}" for n, label in named.items()) + ")" if named else "") + ".", ""]
    lines += md_table(["measure", "best baseline", "daskflow-kv", "daskflow-kv vs best baseline"], body)
    ts = doc.get("targets") or targets(doc, summary)
    missed = [t for t in ts if t["ok"] is False]
    lines += ["", _agreement(summary),
              "", f"Targets met: {sum(t['ok'] is True for t in ts)} of {len(ts)}"
              + ("; missed: " + "; ".join(f"{t['target']} ({t['detail']})" for t in missed) if missed else "") + "."]
    if code is not None:
        lines += ["", code_line(code)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Re-render the README blocks from a saved run, without measuring again."""
    ap = validation.ArgumentParser(prog="python -m daskflow_kv.bench.readme_blocks", description=main.__doc__)
    ap.add_argument("run_json", help="a bench_<tag>.json written by `daskflow-kv bench`")
    ap.add_argument("--readme", required=True, help="as for `daskflow-kv bench --readme`")
    ap.add_argument("--only", choices=("headline", "results"), help="rewrite only this kind of block")
    ap.add_argument("--across-commits", action="store_true", help="summarize rows of different commits together")
    ap.add_argument("--across-hosts", action="store_true", help="summarize rows of different hosts together")
    args = ap.parse_args(argv)
    try:
        path = Path(validation.readable_file("run_json", args.run_json))
        doc = json.loads(path.read_text())
        if not doc.get("runs"):
            raise InvalidInputError(f"{str(path)!r} holds no runs to render")
        readme_files(args.readme)
        # the medians as the run summarized them (its targets too: readme_table reads doc["targets"])
        summary = doc.get("summary") or summarize(doc["runs"], args.across_commits, args.across_hosts)
    except (InvalidInputError, ValueError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    only = {"headline": HEADLINE_MARKERS, "results": RESULTS_MARKERS}.get(args.only)
    for line in update_readmes(args.readme, doc, summary, path, summary_file(path.parent, doc["tag"]), only):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
