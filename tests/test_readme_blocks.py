"""The generated blocks of README.md and benchmarks/README.md. Pure: no cluster, no model.

The committed blocks must be exactly what ``readme_blocks`` renders from the published
run's JSON (nothing hand-typed); README's headline names every change to the measured code
its run does not include (``measured_code``: a headline older than the code fails here
until it is re-made, or re-rendered to list them); one ``--readme README.md`` rewrites README's headline and
benchmarks/README.md's full block, with links relative to each file; a marker quoted in a
sentence is not a block; a file with no block is refused before any run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from daskflow_kv.bench import measured_code
from daskflow_kv.bench import readme_blocks as rb
from daskflow_kv.bench.provenance import git
from daskflow_kv.bench.run import main as bench_main
from daskflow_kv.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "benchmarks" / "results" / "bench_full.json"


def _block(text: str, markers) -> str:
    start, end = markers
    return text.split(f"\n{start}\n", 1)[1].split(f"\n{end}", 1)[0]


def _published():
    doc = json.loads(PUBLISHED.read_text())
    return doc, doc["summary"]


def test_committed_blocks_are_rendered_from_the_published_json():
    """benchmarks/README.md's full block from bench_full.json; README's headline from the run
    it links (the full run, or a later run of the headline's experiments on newer code)."""
    doc, summary = _published()
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    assert rb.blocks_in(readme) == [rb.HEADLINE_MARKERS] and rb.blocks_in(bench) == [rb.RESULTS_MARKERS]
    assert _block(bench, rb.RESULTS_MARKERS) == rb.readme_table(doc, summary, "results/SUMMARY.md").rstrip()
    link, hdoc = _headline(readme)
    code = measured_code.not_included(hdoc, ROOT / link)
    assert _block(readme, rb.HEADLINE_MARKERS) == rb.headline_table(hdoc, hdoc["summary"], link, code).rstrip()


def _headline(readme: str) -> tuple[str, dict]:
    """README's headline block: the JSON it cites (its link) and that JSON."""
    [link] = set(re.findall(r"\]\((benchmarks/results/bench_[\w.-]+\.json)\)", _block(readme, rb.HEADLINE_MARKERS)))
    return link, json.loads((ROOT / link).read_text())


@pytest.mark.skipif(git("rev-parse", "HEAD") is None, reason="not a git checkout: no history to read")
def test_headline_names_every_change_to_the_measured_code_it_does_not_include():
    """README's headline run measured one commit's code (recorded in its JSON; for a JSON from
    before provenance, the commit that added it). Every later commit that changed the
    measured code, and every measured file its tree had uncommitted, must be named in the
    block; a headline re-made at HEAD on a clean tree names none and passes strictly."""
    readme = (ROOT / "README.md").read_text()
    block = _block(readme, rb.HEADLINE_MARKERS)
    link, hdoc = _headline(readme)
    code = measured_code.not_included(hdoc, ROOT / link)
    assert code["commit"] is not None, f"{link}: {code['how']}"
    assert code["later"] is not None, f"{link}: its commit {code['commit'][:7]} is not an ancestor of HEAD"
    unnamed = [h for h, _ in code["later"] if f"`{h}`" not in block] + [f for f in code["uncommitted"]
                                                                        if f"`{f}`" not in block]
    assert not unnamed, (f"README's headline ({link}, measured at {code['commit'][:7]}) does not include "
                         f"{', '.join(unnamed)}: re-make it at HEAD, or re-render it to name them "
                         f"(python -m daskflow_kv.bench.readme_blocks {link} --readme README.md --only headline)")


def test_headline_compares_with_the_best_baseline_and_names_missed_targets():
    doc, summary = _published()
    text = rb.headline_table(doc, summary)
    rows = [line for line in text.splitlines() if line.startswith("| mean TTFT") or line.startswith("| completed")]
    streams = {r.get("stream", "uniform") for r in summary if r["exp"] == "exp7"}
    assert len(rows) == 4 + len(streams)  # shortest and longest context, cold and warm; each stream
    assert all(sum(r.count(f"({b})") for b in ("local", "hf", "text")) == 1 and "**" in r for r in rows)
    assert "tokens matched text replay's at every point" in text
    missed = [t["target"] for t in doc["targets"] if t["ok"] is False]
    assert missed and all(t in text for t in missed)
    assert f"Targets met: {sum(t['ok'] is True for t in doc['targets'])} of {len(doc['targets'])}" in text
    # the CPU it ran on: headlines made on different hosts are told apart at a glance
    assert f"worker processes on {doc['machine']['cpu']} ({doc['machine']['cores']} cores)" in text


def _tree(tmp_path):
    """A README with a headline block and benchmarks/README.md quoting a marker, then holding the block."""
    (tmp_path / "benchmarks").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- bench:headline:start -->\nSTALE-BLOCK\n<!-- bench:headline:end -->\n\nafter\n")
    bench = tmp_path / "benchmarks" / "README.md"
    bench.write_text("The block sits between `<!-- bench:results:start -->` and its end marker.\n\n"
                     "<!-- bench:results:start -->\nSTALE-BLOCK\n<!-- bench:results:end -->\ntail\n")
    return readme, bench


def test_one_readme_flag_rewrites_both_files_with_relative_links(tmp_path):
    doc, summary = _published()
    readme, bench = _tree(tmp_path)
    json_path, summary_path = tmp_path / "benchmarks" / "results" / "r.json", tmp_path / "benchmarks" / "results" / "S.md"
    lines = rb.update_readmes(readme, doc, summary, json_path, summary_path)
    assert len(lines) == 2
    r, b = readme.read_text(), bench.read_text()
    assert "STALE-BLOCK" not in r and r.endswith("<!-- bench:headline:end -->\n\nafter\n")
    assert "(benchmarks/results/r.json)" in r
    assert b.startswith("The block sits between `<!-- bench:results:start -->` and its end marker.\n\n")
    assert "STALE-BLOCK" not in b and b.endswith("<!-- bench:results:end -->\ntail\n") and "(results/S.md)" in b
    rb.update_readmes(readme, doc, summary, json_path, summary_path)  # idempotent
    assert (readme.read_text(), bench.read_text()) == (r, b)


def test_rerender_entry_point(tmp_path):
    readme, bench = _tree(tmp_path)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir()
    shutil.copy(PUBLISHED, results / "bench_full.json")
    assert rb.main([str(results / "bench_full.json"), "--readme", str(readme)]) == 0
    assert "(benchmarks/results/bench_full.json)" in readme.read_text()
    assert "(results/SUMMARY.md)" in bench.read_text()  # the full profile's summary name


def test_only_the_headline_is_rendered_from_a_run_of_some_experiments(tmp_path):
    readme, bench = _tree(tmp_path)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir()
    shutil.copy(PUBLISHED, results / "bench_headline.json")
    before = bench.read_text()
    assert rb.main([str(results / "bench_headline.json"), "--readme", str(readme), "--only", "headline"]) == 0
    assert "(benchmarks/results/bench_headline.json)" in readme.read_text()
    assert bench.read_text() == before


def test_a_readme_without_blocks_is_refused_before_the_run(tmp_path, capsys):
    plain = tmp_path / "README.md"
    plain.write_text("quotes `<!-- bench:results:start -->` and `<!-- bench:results:end -->` only\n")
    with pytest.raises(InvalidInputError, match="has a <!-- bench:results:start -->"):
        rb.readme_files(plain)
    assert bench_main(["--profile", "smoke", "--out", str(tmp_path), "--readme", str(plain)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("daskflow-kv bench: error: --readme") and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("bench_*"))  # nothing ran
    assert rb.main([str(PUBLISHED), "--readme", str(plain)]) == 2


def test_a_bench_run_of_some_experiments_rewrites_only_the_headline():
    """``bench --experiments 1,7 --readme README.md`` once replaced benchmarks/README.md's full
    results table with its two experiments."""
    from daskflow_kv.bench.run import readme_blocks_of

    assert readme_blocks_of({"experiments": [1, 7]}) == rb.HEADLINE_MARKERS
    assert readme_blocks_of({"experiments": list(range(1, 9))}) is None


def test_rows_of_two_commits_are_not_rendered_as_one_run_unless_told(tmp_path, capsys):
    """A JSON whose runs were pooled from two commits is refused in one line, not summarized."""
    readme, _ = _tree(tmp_path)
    doc, _ = _published()
    runs = [dict(r, origin=f"{'a' * 12 if i % 2 else 'b' * 12}@h1") for i, r in enumerate(doc["runs"])]
    pooled = tmp_path / "pooled.json"
    pooled.write_text(json.dumps({k: v for k, v in doc.items() if k not in ("summary", "targets")} | {"runs": runs}))
    assert rb.main([str(pooled), "--readme", str(readme), "--only", "headline"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--across-commits" in err and "STALE-BLOCK" in readme.read_text()
    assert rb.main([str(pooled), "--readme", str(readme), "--only", "headline", "--across-commits"]) == 0
