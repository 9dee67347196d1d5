"""The front door and the manual: links that resolve, examples that can run, the set-up commands.

Pure file checks, no cluster: every relative link in README.md, docs/*.md and
benchmarks/README.md names a file that exists (and a heading of it, when it has an
anchor); every Python example that starts a local cluster has the main guard (without it
multiprocessing's spawn re-imports the script in each worker and the cluster fails with
"Nanny failed to start"); README keeps the two set-up commands CI and the demo rely on.
The results tree holds what the pages cite: every result a page cites exists, and every file
at the top of benchmarks/results/ is cited by a page (the rest is history, in archive/).
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# Calls that start a cluster in this process (kv_runtime only without an address)
STARTS_A_CLUSTER = re.compile(r"embedded_runtime\(|LocalCluster\(|local_cluster\(|cuda_cluster\(|slurm_cluster\("
                              r"|kv_runtime\(\s*\)|\.run\([^)]*mode=")


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.is_file(), page
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_githubs_rule():
    assert _slug("The catalog as Arrow / Parquet") == "the-catalog-as-arrow--parquet"
    assert _slug("Parallel materialize (exp 8)") == "parallel-materialize-exp-8"
    assert _slug("The `daskflow-kv` command") == "the-daskflow-kv-command"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_that_start_a_cluster_have_the_main_guard(page):
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    unguarded = [b.splitlines()[0] for b in blocks
                 if STARTS_A_CLUSTER.search(b) and 'if __name__ == "__main__":' not in b]
    assert not unguarded, f"{page.relative_to(ROOT)}: examples without the main guard start with {unguarded}"


def test_readme_is_a_front_door_with_the_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 180
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert f"\n{command}\n" in text, command  # .ci/run and the pre-stop check look for it
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, f"README does not link {page.name}"
    assert "(benchmarks/README.md)" in text


RESULTS = ROOT / "benchmarks" / "results"
SPAN = re.compile(r"`([^`\s]+)`")


def _expand(pattern: str) -> list[str]:
    """``a_{1,2}.json`` -> ``a_1.json``, ``a_2.json`` (as a shell expands braces)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _cited_results(page: Path) -> tuple[list[str], set[Path]]:
    """What a page cites of benchmarks/results/: (the patterns it names by path that match no
    file, the files it cites). A page cites a result by a link to it, by a code span holding its
    path (``results/x.json`` or ``benchmarks/results/x.json``; ``*`` and ``{a,b}`` allowed), or by
    a code span holding only a result's file name. Commands name files they write; a path inside
    a longer code span is not a citation."""
    text = _prose(page.read_text())
    paths = [str((page.parent / t.partition("#")[0]).resolve()) for t in LINK.findall(text)
             if not re.match(r"^[a-z]+:", t) and t.partition("#")[0]]
    names = []
    for span in SPAN.findall(text):
        if re.match(r"(benchmarks/)?results/", span):
            paths.append(str(ROOT / "benchmarks" / span.removeprefix("benchmarks/")))
        elif "/" not in span and re.search(r"\.(json|md|csv|png)$", span):
            names += [str(RESULTS / span), str(RESULTS / "archive" / span)]
    missing, files = [], set()
    for pattern in (p for x in paths for p in _expand(x) if p.startswith(str(RESULTS) + "/")):
        hits = glob.glob(pattern)
        if not hits:
            missing.append(str(Path(pattern).relative_to(ROOT)))
        files |= {Path(h) for h in hits}
    files |= {Path(h) for x in names for p in _expand(x) for h in glob.glob(p)}
    return missing, files


def test_every_cited_result_exists_and_every_kept_result_is_cited():
    cited, missing = set(), []
    for page in PAGES:
        gone, files = _cited_results(page)
        missing += [f"{page.relative_to(ROOT)}: {m}" for m in gone]
        cited |= files
    assert not missing, "cited but not in benchmarks/results/: " + "; ".join(missing)
    uncited = sorted(f.name for f in RESULTS.iterdir() if f.is_file() and f not in cited)
    assert not uncited, (f"benchmarks/results/ keeps {len(uncited)} files no page cites (cite them, or git mv them "
                         f"to benchmarks/results/archive/): {', '.join(uncited[:20])}")
