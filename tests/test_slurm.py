"""A workflow on a real Slurm: worker jobs started by ``sbatch`` through dask-jobqueue.

Runs where ``sinfo`` answers (``SLURM_CHECK_PYTEST=1 bash scripts/slurm_check.sh`` brings
up a single-node Slurm and runs this file); skipped otherwise. Uses the functions of
``scripts/slurm_check.py``, so it checks what the script checks, on a smaller workflow.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sinfo_answers() -> str | None:
    """None when a Slurm controller answers, else why not."""
    if shutil.which("sinfo") is None:
        return "no Slurm here: sinfo not found (bash scripts/slurm_check.sh starts one)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20s"
    if out.returncode != 0 or not out.stdout.strip():
        said = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
        return f"no Slurm answers (sinfo exited {out.returncode}: {said[-1] if said else 'nothing'})"
    return None


why = _sinfo_answers()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")
pytest.importorskip("dask_jobqueue")


def _load_check():
    spec = importlib.util.spec_from_file_location("slurm_check", ROOT / "scripts" / "slurm_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


check = _load_check() if why is None else None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Two worker jobs that import this checkout's daskflow_kv."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)  # forwarded into the jobs
    try:
        cluster, client = check.start(2, str(tmp_path_factory.mktemp("slurm-jobs")), "00:10:00", timeout=120)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    try:
        yield cluster, client
    finally:
        client.close()
        cluster.close()


@pytest.fixture(scope="module")
def setup(slurm):
    from daskflow_kv.flow.executor import run_text_mode
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    cluster, client = slurm
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    wf = check.build("debate", rt.tokenizer, agents=2, rounds=2, context_tokens=96, max_new_tokens=6)
    text = run_text_mode(check._compiled(wf, rt), rt)
    return cluster, client, wf, text


def test_workflow_on_slurm_jobs_matches_text_mode(setup):
    from daskflow_kv.flow.executor import Comparison, run_state_mode
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    cluster, client, wf, text = setup
    where = check.Placements()
    jobs = {job for job, _ in where.refresh(client).values()}
    assert len(jobs) == 2 and "?" not in jobs  # each worker is its own Slurm job
    assert all(client.run(lambda: "daskflow_kv.transport.serialization" in __import__("sys").modules).values())
    assert "daskflow-kv" in cluster.scheduler.plugins
    rt = KVRuntime(client, "tiny-llama", block_size=16, namespace="test-both")
    cmp = Comparison(run_state_mode(check._compiled(wf, rt), rt), text)
    assert cmp.all_agree, cmp.agreement
    assert {where.job(a.worker) for a in cmp.state.agents.values()} <= jobs


def test_scancel_mid_workflow_recovers_exactly_and_adapt_replaces_the_job(setup):
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    cluster, client, wf, text = setup
    where = check.Placements()
    rt = KVRuntime(client, "tiny-llama", block_size=16, namespace="test-cancel")
    cmp, hit = check.cancel_mid_workflow(rt, wf, text, where, at_level=1)
    assert cmp.all_agree, cmp.agreement  # identical to text mode after the job died
    assert check.job_state(hit.job) in ("CANCELLED", "COMPLETING", "gone")
    assert hit.lost and hit.recomputed <= hit.lost and hit.recomputed  # lineage, not re-materialized
    assert check.n_workers(client) == 1

    adaptive = cluster.adapt(minimum_jobs=2, maximum_jobs=2)
    try:
        check.wait_for(lambda: check.n_workers(client) == 2, 90, "adapt to replace the cancelled job")
    finally:
        adaptive.stop()
    jobs = {job for job, _ in where.refresh(client).values()}
    assert hit.job not in jobs and len(jobs) == 2


def test_scale_down_retires_a_worker_and_keeps_its_kv(setup):
    from daskflow_kv.flow.executor import Comparison, run_state_mode
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    cluster, client, wf, text = setup
    if check.n_workers(client) != 2:
        cluster.scale(jobs=2)
        client.wait_for_workers(2, timeout=90)
    rt = KVRuntime(client, "tiny-llama", block_size=16, namespace="test-scale")
    first = run_state_mode(check._compiled(wf, rt), rt)
    before = check.held_blocks(rt)
    assert len({w for ws in before.values() for w in ws}) == 2  # both workers hold KV blocks
    cluster.scale(jobs=1)
    check.wait_for(lambda: check.n_workers(client) == 1, 90, "scale(jobs=1)")
    after = check.held_blocks(rt)
    assert set(before) <= set(after)  # the retiring worker handed its blocks over
    again = Comparison(run_state_mode(check._compiled(wf, rt), rt), text)
    assert again.all_agree, again.agreement
    reused = sum(a.tokens_reused for a in again.state.agents.values())
    assert sum(again.state.level_tokens_computed) < sum(first.level_tokens_computed) and reused > 0
