"""The front door and the manual: links that resolve, examples that can run, the set-up commands.

Pure file checks, no cluster: every relative link in README.md, docs/*.md and
benchmarks/README.md names a file that exists (and a heading of it, when it has an
anchor); every Python example that starts a local cluster has the main guard (without it
multiprocessing's spawn re-imports the script in each worker and the cluster fails with
"Nanny failed to start"); README keeps the two set-up commands CI and the demo rely on.
"""

from __future__ import annotations

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
