"""Which changes to the measured code a published result does not include.

The rule, one for every result: the *measured code* is everything under ``daskflow_kv/`` and
``plugins/`` except what only reads results after a run (``REPORT_ONLY``: summaries, tables,
the simulator). A result measured the code of its commit (``provenance.commit``); every
later commit that changed the measured code, and every measured file its tree had
uncommitted, is a change the result does not include. README's headline block names them
(``readme_blocks.headline_table``) and tests/test_readme_blocks.py fails when it does not,
so a headline re-made at HEAD lists none. A result from before provenance has no commit: the
commit that added its JSON to the repository stands in for it (the run measured no newer code).
"""

from __future__ import annotations

from pathlib import Path

from .provenance import ROOT, git

MEASURED = ("daskflow_kv", "plugins")
# Modules that run only after a measurement, on its results: a change to them moves no figure.
REPORT_ONLY = ("daskflow_kv/sim", *(f"daskflow_kv/bench/{m}.py" for m in (
    "summary", "report", "report_md", "readme_blocks", "provenance", "measured_code", "reliability_table",
    "gate_effect", "exp7_modeled", "exp7_why", "gpu_report", "gpu_check", "plan", "calibration_spread")))
SUBJECT_WORDS = 8  # a change is named by its short hash and the first words of its subject


def is_measured(path: str) -> bool:
    """Whether a repository path is measured code (``MEASURED`` less ``REPORT_ONLY``)."""
    inside = lambda p, d: p == d or p.startswith(d.rstrip("/") + "/")  # noqa: E731
    return any(inside(path, d) for d in MEASURED) and not any(inside(path, d) for d in REPORT_ONLY)


def base_commit(doc: dict, json_path: Path, root: Path = ROOT) -> tuple[str | None, str]:
    """(commit, how it is known) of the code a result measured: its recorded commit, or the
    commit that added its JSON ("added"); (None, why) when neither is known."""
    commit = (doc.get("provenance") or {}).get("commit")
    if commit:
        return commit, "recorded"
    try:
        rel = Path(json_path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None, f"{Path(json_path).name} records no commit and lies outside the repository"
    added = git("log", "--diff-filter=A", "--format=%H", "--", rel, root=root)
    if added:
        return added.splitlines()[-1], "added"
    return None, f"{rel} records no commit and is not in the repository's history"


def changes_since(commit: str, root: Path = ROOT) -> list[tuple[str, str]] | None:
    """(short hash, subject's first words) of each commit after ``commit`` up to HEAD that
    changed measured code, oldest first; None when ``commit`` is not an ancestor of HEAD."""
    if git("merge-base", "--is-ancestor", commit, "HEAD", root=root) is None:
        return None
    spec = [*MEASURED, *(f":(exclude){p}" for p in REPORT_ONLY)]
    log = git("log", "--no-merges", "--reverse", "--format=%h%x09%s", f"{commit}..HEAD", "--", *spec, root=root)
    out = []
    for line in (log or "").splitlines():
        short, _, subject = line.partition("\t")
        words = subject.split()
        out.append((short, " ".join(words[:SUBJECT_WORDS]) + (" …" if len(words) > SUBJECT_WORDS else "")))
    return out


def uncommitted(doc: dict) -> list[str]:
    """The measured files a result's tree had changed when it ran (its ``provenance``)."""
    p = doc.get("provenance") or {}
    return [f for f in p.get("dirty_files") or [] if is_measured(f)]


def not_included(doc: dict, json_path: Path, root: Path = ROOT) -> dict:
    """What README's headline must say about the code its run measured: ``commit`` and ``how``
    (``base_commit``), ``later`` (``changes_since``; None: not an ancestor of HEAD) and
    ``uncommitted``."""
    commit, how = base_commit(doc, json_path, root)
    return {"commit": commit, "how": how, "later": None if commit is None else changes_since(commit, root),
            "uncommitted": uncommitted(doc)}
