"""Every result names its commit and host; rows of different ones are not compared unasked.

Pure or on a throw-away git repository: no cluster, no model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daskflow_kv.bench import measured_code, provenance
from daskflow_kv.bench.common import write_json
from daskflow_kv.bench.summary import summarize

ROOT = Path(__file__).resolve().parents[1]
HAS_GIT = provenance.git("--version") is not None


def test_host_id_is_the_same_in_every_process():
    """``hash()`` of the host name, the id before, differed in every process."""
    code = "from daskflow_kv.bench import provenance; print(provenance.host()['id'])"
    ids = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
           for _ in range(2)}
    assert ids == {provenance.host()["id"]}
    h = provenance.host()
    assert h["cpu"] and h["cores"] >= 1 and h["memory_gib"] >= 1 and re.fullmatch(r"[0-9a-f]{12}", h["id"])


def test_a_legacy_result_gets_its_host_id_from_its_machine_facts():
    h = provenance.host()
    legacy = {"machine": {"cpu": h["cpu"], "cores": h["cores"], "memory_bytes": h["memory_gib"] * 2**30 + 12345}}
    assert provenance.origin(legacy) == (None, h["id"])
    assert provenance.origin({"machine": {"cpu": "other", "cores": 2, "memory_bytes": 2**30}})[1] != h["id"]


def test_write_json_stamps_commit_host_versions_command_and_wall_time(tmp_path):
    path = write_json(tmp_path / "r.json", {"command": "python benchmarks/x.py --n 3", "value": 1.0})
    p = json.loads(path.read_text())["provenance"]
    assert p["command"] == "python benchmarks/x.py --n 3"
    assert p["host"] == provenance.host() and p["wall_s"] >= 0
    assert set(p["versions"]) == {"python", "torch", "transformers", "dask", "distributed"}
    assert p["versions"]["torch"] and p["versions"]["distributed"]
    if HAS_GIT:
        assert p["commit"] == provenance.git("rev-parse", "HEAD") and isinstance(p["dirty"], bool)
        assert not any(f.startswith("benchmarks/results/") for f in p["dirty_files"])


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    return repo


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", message], check=True)
    return provenance.git("rev-parse", "HEAD", root=repo)


@pytest.mark.skipif(not HAS_GIT, reason="git not installed")
def test_dirty_files_are_named_and_the_runs_outputs_left_out(tmp_path):
    repo = _repo(tmp_path)
    head = _commit(repo, {"a.py": "1", "b.py": "1", "benchmarks/results/r.json": "{}"}, "first")
    assert provenance.git_state(repo) == {"commit": head, "dirty": False, "dirty_files": [], "dirty_count": 0}
    provenance.git_state.cache_clear()
    (repo / "a.py").write_text("2")
    (repo / "new file.py").write_text("")
    (repo / "benchmarks/results/r.json").write_text("[]")
    subprocess.run(["git", "-C", str(repo), "mv", "b.py", "c.py"], check=True)
    state = provenance.git_state(repo)
    provenance.git_state.cache_clear()
    assert state["dirty"] and state["dirty_files"] == ["a.py", "c.py", "new file.py"]


def _doc(commit, host="h1", dirty=False):
    return {"provenance": {"commit": commit, "dirty": dirty, "host": {"id": host}}}


def test_results_of_other_commits_or_hosts_are_refused_in_one_line_unless_allowed():
    a, b = "a" * 40, "b" * 40
    provenance.check([("x.json", _doc(a)), ("y.json", _doc(a))])
    for other, flag in ((_doc(b), "--across-commits"), (_doc(None), "--across-commits"),
                        (_doc(a, dirty=True), "--across-commits"), (_doc(a, host="h2"), "--across-hosts")):
        with pytest.raises(provenance.IncomparableResults, match=flag) as e:
            provenance.check([("x.json", _doc(a)), ("y.json", other)])
        assert len(str(e.value).splitlines()) == 1 and "x.json" in str(e.value) and "y.json" in str(e.value)
    provenance.check([("x.json", _doc(a)), ("y.json", _doc(b, host="h2"))], across_commits=True, across_hosts=True)
    with pytest.raises(provenance.IncomparableResults, match="unrecorded"):  # two unknowns are not one commit
        provenance.check([("x.json", _doc(None)), ("y.json", _doc(None))])


def _row(rep, origin=None, wall=1.0):
    r = {"exp": "exp1", "context": 512, "system": "dkv", "phase": "cold", "rep": rep, "agree": True, "wall_s": wall}
    return r if origin is None else {**r, "origin": origin}


def test_summary_refuses_to_pool_rows_of_different_origins():
    """The medians of a mix hide what moved: rows of two commits, or two hosts, are refused."""
    provenance.tag_rows(rows := [_row(0), _row(1)])
    assert len({r["origin"] for r in rows}) == 1 and rows[0]["origin"].endswith("@" + provenance.host()["id"])
    assert summarize(rows)[0]["reps"] == 2
    assert summarize([_row(0), _row(1)])[0]["reps"] == 2  # untagged: one run's rows, as before
    mixed = [_row(0, "aaaaaaaaaaaa@h1"), _row(1, "bbbbbbbbbbbb@h1", 3.0)]
    with pytest.raises(provenance.IncomparableResults, match="--across-commits"):
        summarize(mixed)
    assert summarize(mixed, across_commits=True)[0]["wall_s"] == 2.0
    with pytest.raises(provenance.IncomparableResults, match="--across-hosts"):
        summarize([_row(0, "aaaaaaaaaaaa@h1"), _row(1, "aaaaaaaaaaaa@h2")])


@pytest.mark.skipif(not HAS_GIT, reason="git not installed")
def test_changes_a_result_does_not_include_are_the_measured_codes_later_commits(tmp_path):
    repo = _repo(tmp_path)
    measured = _commit(repo, {"daskflow_kv/engine.py": "1", "benchmarks/results/bench_h.json": "{}"}, "the run")
    _commit(repo, {"daskflow_kv/sim/loop.py": "1", "daskflow_kv/bench/report_md.py": "1", "docs/a.md": "x"},
            "reporting only")
    _commit(repo, {"plugins/kv_gate.py": "1"}, "the gate changed in a way that matters to every figure")
    later = measured_code.changes_since(measured, repo)
    assert [s for _, s in later] == ["the gate changed in a way that matters …"]
    head = provenance.git("rev-parse", "HEAD", root=repo)
    assert measured_code.changes_since(head, repo) == []
    # no commit recorded: the commit that added the JSON stands in
    code = measured_code.not_included({}, repo / "benchmarks/results/bench_h.json", repo)
    assert (code["commit"], code["how"], len(code["later"])) == (measured, "added", 1)
    recorded = measured_code.not_included(
        {"provenance": {"commit": head, "dirty_files": ["plugins/kv_gate.py", "docs/a.md", "daskflow_kv/sim/x.py"]}},
        repo / "benchmarks/results/bench_h.json", repo)
    assert recorded == {"commit": head, "how": "recorded", "later": [], "uncommitted": ["plugins/kv_gate.py"]}
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "-b", "side", measured], check=True)
    elsewhere = _commit(repo, {"daskflow_kv/engine.py": "2"}, "elsewhere")
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "-"], check=True)
    assert measured_code.changes_since(elsewhere, repo) is None  # not an ancestor of HEAD


def test_measured_code_is_the_package_less_what_only_reads_results():
    assert measured_code.is_measured("daskflow_kv/runtime/kv_runtime.py") and measured_code.is_measured("plugins/x.py")
    assert measured_code.is_measured("daskflow_kv/bench/load.py")
    for path in ("daskflow_kv/sim/loop.py", "daskflow_kv/bench/readme_blocks.py", "docs/placement.md", "tests/x.py",
                 "benchmarks/results/x.json"):
        assert not measured_code.is_measured(path), path
    for path in measured_code.REPORT_ONLY:
        assert (ROOT / path).exists(), f"REPORT_ONLY names {path}, which does not exist"


WRITES_JSON = re.compile(r"write_text\(json\.dumps\(|json\.dump\(")
# Writers whose output is not a result: the steps one process of step_cost.py hands back to it
# Not results: a step-cost dump of the loop's recent steps; an emulator profile (data the
# emulator loads, naming the commits and hosts of the steps it was fitted on itself).
NOT_RESULTS = {("benchmarks/step_cost.py", "loop.recent"), ("benchmarks/emulated_profiles.py", "out.write_text")}


def test_every_json_writer_of_the_benchmarks_stamps_its_provenance():
    """Results go through ``common.write_json`` (which stamps) or call ``provenance.stamp``."""
    files = [*sorted((ROOT / "daskflow_kv" / "bench").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
             ROOT / "daskflow_kv" / "sim" / "cli.py"]
    unstamped = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if WRITES_JSON.search(line) and "stamp(" not in line and f.name != "common.py" \
                    and not any(rel == p and mark in line for p, mark in NOT_RESULTS):
                unstamped.append(f"{rel}:{n}")
    assert not unstamped, f"JSON written without provenance at {', '.join(unstamped)}"


def _script(name: str):
    """A script of benchmarks/ imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_prov_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exp7_run(path: Path, commit: str | None, cpu: str = "cpu A") -> Path:
    rows = [{"exp": "exp7", "stream": "zipf", "rep": 0, "system": s, "rate": 60.0, "completed_per_min": v,
             "tokens_prefilled": 100, "workflows": 4, "completed": 4, "agree": True, "latency_p95_s": 9.0}
            for s, v in (("dkv", 30.0), ("local", 25.0))]
    doc = {"command": "x", "machine": {"cpu": cpu, "cores": 2, "memory_bytes": 2**34}, "runs": rows}
    if commit:
        doc["provenance"] = {"commit": commit, "dirty": False, "host": provenance.host_of(cpu, 2, 2**34)}
    path.write_text(json.dumps(doc))
    return path


def test_the_ab_tools_refuse_runs_of_other_commits_or_hosts_unless_told(tmp_path, capsys):
    exp7_ab, rebuild_ab = _script("exp7_ab"), _script("rebuild_ab")
    a, b = _exp7_run(tmp_path / "a.json", "a" * 40), _exp7_run(tmp_path / "b.json", "b" * 40)
    other_host = _exp7_run(tmp_path / "c.json", "b" * 40, cpu="cpu B")
    with pytest.raises(SystemExit) as e:
        exp7_ab.main([str(a), str(b)])
    assert e.value.code == 2 and "--across-commits" in capsys.readouterr().err
    assert exp7_ab.main([str(a), str(b), "--across-commits"]) == 0
    with pytest.raises(SystemExit):
        exp7_ab.main([str(a), str(other_host), "--across-commits"])
    assert "--across-hosts" in capsys.readouterr().err
    assert exp7_ab.main([str(a), str(other_host), "--across-commits", "--across-hosts"]) == 0
    out = tmp_path / "ab.json"
    rebuild_ab.main(["--old", str(a), "--new", str(b), "--out", str(out)])  # the sides' commits differ: the A/B
    assert json.loads(out.read_text())["provenance"]["commit"] == provenance.git_state()["commit"]
    legacy = _exp7_run(tmp_path / "legacy.json", None)
    with pytest.raises(SystemExit):  # one side's runs of unknown commits are not pooled unasked
        rebuild_ab.main(["--old", str(a), str(legacy), "--new", str(b), "--out", str(out)])
    assert "--across-commits" in capsys.readouterr().err


def test_a_result_is_described_in_one_line_by_its_commit_tree_and_host():
    clean = {"provenance": {"commit": "c" * 40, "dirty": False, "dirty_files": [], "host": {"id": "h1"}}}
    assert provenance.describe(clean) == f"commit `{'c' * 12}` (a clean tree); host `h1`"
    dirty = {"provenance": {"commit": "c" * 40, "dirty": True, "dirty_files": list("abcdef"), "dirty_count": 9,
                            "host": {"id": "h1"}}}
    assert provenance.describe(dirty) == f"commit `{'c' * 12}` (9 files changed: a, b, c, d, e, ...); host `h1`"
    assert provenance.describe({"machine": {"cpu": "x", "cores": 2, "memory_bytes": 2**30}}).startswith(
        "commit not recorded; host `")
