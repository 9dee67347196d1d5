"""Bad input fails fast, in one clear line, before any cluster, model or task; nothing is left behind.

CLI rows run ``python -m daskflow_kv.cli`` in a subprocess and measure it: exit status 2,
exactly one line on stderr, no traceback, under 2 s. API rows call the public operators with
the expensive parts (forward passes, RPCs, task submission) replaced by tripwires, so a row
passes only if the error comes before any of them.
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
import pytest
import torch
from conftest import CONTEXT, make_engine

from daskflow_kv import validation
from daskflow_kv.errors import InvalidInputError, WorkflowError

ROOT = Path(__file__).resolve().parents[1]
FAST_S = 2.0  # the bound on every rejected command


# -- the CLI --------------------------------------------------------------------------------------
def _cli(args, env=None, timeout=60):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "daskflow_kv.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=timeout)
    return proc, time.perf_counter() - t


R = ["run", "debate"]
CLI_CASES = [
    # (argv, environment, what the one line must say)
    # -- the list
    (R + ["--workers", "0"], None, "--workers must be an integer >= 1, got 0"),
    (R + ["--workers", "-1"], None, "--workers must be an integer >= 1, got -1"),
    (R + ["--kv-budget", "banana"], None, "--kv-budget must be a byte size such as 512MiB or 2GB, got 'banana'"),
    (R + ["--block-size", "0"], None, "--block-size must be an integer >= 1, got 0"),
    (R + ["--agents", "-1"], None, "--agents must be an integer from 1 to 1024, got -1"),
    (R + ["--model", "/nonexistent"], None, "'/nonexistent' is not a known model (tiny-gemma3, tiny-llama, tiny-llama4, tiny-mistral, tiny-qwen2, smollm2, llama-3.2-1b-mini, llama-3.2-1b-random)"),
    (["run", "nosuchworkflow"], None, "unknown workflow 'nosuchworkflow'; choose from tot, debate, rag, planner"),
    (R + ["--scheduler", "tcp://127.0.0.1:1"], None, "cannot reach a scheduler (connection refused); check that"),
    # -- every other option of run / demo / explain
    (R + ["--workers", "banana"], None, "argument --workers: invalid int value: 'banana'"),
    (R + ["--kv-budget=-5GiB"], None, "--kv-budget must be a byte size such as 512MiB or 2GB, got '-5GiB'"),
    (R + ["--kv-store", "nosuchproto://bucket/kv"], None, "--kv-store 'nosuchproto://bucket/kv': unknown storage protocol"),
    (R + ["--kv-store", "/proc/version/kv"], None, "--kv-store '/proc/version/kv': '/proc/version' is a file"),
    (R, {"DASK_DASKFLOW_KV__STORE__URL": "nosuchproto://x"}, "setting daskflow-kv.store.url 'nosuchproto://x'"),
    (["store", "gc", "--kv-store", "/tmp", "--older-than", "soon"], None, "--older-than must be a duration"),
    (R + ["--block-size", "-3"], None, "--block-size must be an integer >= 1"),
    (R + ["--agents", "0"], None, "--agents must be an integer from 1 to 1024, got 0"),
    (R + ["--agents", "5000"], None, "--agents must be an integer from 1 to 1024"),
    (R + ["--rounds", "0"], None, "--rounds must be an integer from 1 to 1024, got 0"),
    (R + ["--rounds", "400", "--agents", "4"], None, "1601 agents, more than 1024"),
    (["run", "tot", "--agents", "10", "--depth", "4"], None, "11111 agents, more than 1024"),
    (["run", "rag", "--rounds", "2"], None, "--rounds applies to the debate workflow only"),
    (R + ["--depth", "3"], None, "--depth applies to the tot workflow only"),
    (R + ["--context-tokens", "0"], None, "--context-tokens must be an integer >= 1, got 0"),
    (R + ["--context-tokens", "100000", "--model", "tiny-llama"], None, "exceed tiny-llama's 2048 positions"),
    (R + ["--max-new-tokens", "0"], None, "--max-new-tokens must be an integer >= 1, got 0"),
    (R + ["--max-new-tokens", "-5000"], None, "--max-new-tokens must be an integer >= 1, got -5000"),
    (R + ["--max-new-tokens", "2.5"], None, "argument --max-new-tokens: invalid int value: '2.5'"),
    (R + ["--mode", "fast"], None, "argument --mode: invalid choice: 'fast'"),
    (R + ["--dtype", "int8"], None, "argument --dtype: invalid choice: 'int8'"),
    (R + ["--json", "/nonexistent-dir/out.json"], None, "directory '/nonexistent-dir' does not exist"),
    (R + ["--json", "/tmp"], None, "'/tmp' is a directory, not a file"),
    (R + ["--model", "/tmp"], None, "is a directory without config.json"),
    (R + ["--model", "owner/not-cached"], None, "is not a known model"),
    (R + ["--scheduler", "tcp://127.0.0.1:1", "--workers", "2"], None, "cannot be combined with --scheduler"),
    (R + ["--scheduler", "tcp://127.0.0.1:99999"], None, "a scheduler address such as tcp://host:8786 (port"),
    (R + ["--scheduler", "http://x"], None, "a scheduler address such as tcp://host:8786"),
    (R + ["--bogus"], None, "unrecognized arguments: --bogus"),
    (["demo", "--workers", "0"], None, "--workers must be an integer >= 1"),
    (["explain", "tot", "--depth", "0"], None, "--depth must be an integer from 1 to 1024"),
    (["explain", "nosuchworkflow"], None, "unknown workflow 'nosuchworkflow'"),
    # -- settings the flags fall back on (dask.config, here through the environment)
    (R, {"DASK_DASKFLOW_KV__KV_BUDGET": "banana"}, "setting daskflow-kv.kv-budget must be a byte size such as 512MiB"),
    (R, {"DASK_DASKFLOW_KV__BLOCK_SIZE": "0"}, "setting daskflow-kv.block-size must be an integer >= 1"),
    (R, {"DASK_DASKFLOW_KV__DTYPE": "int8"}, "setting daskflow-kv.dtype must be one of float32, bfloat16"),
    (R, {"DASK_DASKFLOW_KV__CLUSTER__WORKERS": "0"}, "setting daskflow-kv.cluster.workers must be an integer >= 1"),
    (R + ["--parallel-materialize", "0"], None, '--parallel-materialize must be "auto" or an integer >= 1, got 0'),
    (R + ["--parallel-materialize", "half"], None, '--parallel-materialize must be "auto" or an integer >= 1'),
    (R, {"DASK_DASKFLOW_KV__PARALLEL__MATERIALIZE": "-2"},
     'setting daskflow-kv.parallel.materialize must be "auto" or an integer >= 1'),
    (R, {"DASK_DASKFLOW_KV__MODEL": "/nonexistent"}, "setting daskflow-kv.model '/nonexistent' is not a known"),
    (R + ["--agents", "3"], {"DASK_DASKFLOW_KV__MAX_FORK": "2"}, "--agents must be an integer from 1 to 2"),
    # -- bench, plan, catalog
    (["bench", "--workers", "0"], None, "--workers must be an integer >= 1"),
    (["bench", "--reps", "0"], None, "--reps must be an integer >= 1"),
    (["bench", "--experiments", "1,9"], None, "--experiments must be a comma list of 1-8, got '9'"),
    (["bench", "--experiments", "x"], None, "--experiments must be a comma list of 1-8, got 'x'"),
    (["bench", "--exp7-rates", "0"], None, "--exp7-rates must be a number > 0"),
    (["bench", "--exp7-docs", "0"], None, "--exp7-docs must be an integer >= 1"),
    (["bench", "--exp7-context", "0"], None, "--exp7-context must be an integer >= 1"),
    (["bench", "--experiments", "7", "--model", "tiny-llama", "--exp7-context", "1600"], None,
     "--exp7-context 1600 leaves too little room in tiny-llama's 2048 positions: give at most 1536"),
    (["bench", "--experiments", "8", "--parallel-widths", "1", "3"], None, "--parallel-widths asks for 3 workers"),
    (["bench", "--parallel-contexts", "0"], None, "--parallel-contexts must be an integer >= 1"),
    (["bench", "--systems", "text,nope"], None, "--systems must be one of text, hf, local, dkv"),
    (["bench", "--contexts", "0"], None, "--contexts must be an integer >= 1"),
    (["bench", "--ks", "0"], None, "--ks must be an integer from 1 to 1024"),
    (["bench", "--max-new-tokens", "0"], None, "--max-new-tokens must be an integer >= 1"),
    (["bench", "--netem-rates", "-1"], None, "--netem-rates must be a number > 0"),
    (["bench", "--memory-limit", "banana"], None, "--memory-limit must be a positive byte size"),
    (["bench", "--model", "/nonexistent"], None, "--model '/nonexistent' is not a known model"),
    (["bench", "--dtype", "int8"], None, "--dtype must be one of float32, bfloat16, float16"),
    (["bench", "--experiments", "3", "--workers", "1"], None, "--workers must be >= 2 with it"),
    (["bench", "--out", "/etc/hostname/results"], None, "'/etc/hostname' is a file, not a directory"),
    (["bench", "--tag", "a/b"], None, "--tag must be a plain file-name part"),
    (["plan", "--hardware", "abacus"], None, "--hardware must be one of h100-nvlink"),
    (["plan", "--contexts", "0"], None, "--contexts must be an integer >= 1"),
    (["plan", "--mfu", "2"], None, "--mfu must be a number > 0 and <= 1"),
    (["plan", "--tflops", "0"], None, "--tflops must be a number > 0"),
    (["plan", "--model", "nosuch"], None, "unknown model 'nosuch'"),
    (["catalog", "--scheduler", "tcp://127.0.0.1:1", "--out", "/tmp/kv.parquet"], None, "cannot reach a scheduler"),
    (["catalog", "--scheduler", "tcp://127.0.0.1:1", "--out", "/nonexistent-dir/kv.parquet"], None,
     "directory '/nonexistent-dir' does not exist"),
]


@pytest.mark.parametrize("argv,env,message", CLI_CASES, ids=[" ".join(c[0]) + (" +env" if c[1] else "")
                                                             for c in CLI_CASES])
def test_cli_rejects_bad_input_fast_in_one_line(argv, env, message):
    proc, elapsed = _cli(argv, env)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in lines[0], lines[0]
    assert proc.stdout == ""  # nothing started: no progress line either
    assert elapsed < FAST_S, f"took {elapsed:.2f}s"


def test_cli_fails_fast_when_no_scheduler_answers():
    """A host that drops packets fails after the connect timeout; one that answers something
    other than Dask (this sandbox's network does that) fails at the handshake. One line, no hang."""
    proc, elapsed = _cli(R + ["--scheduler", "tcp://10.255.255.1:8786"], {"DASK_DASKFLOW_KV__CONNECT_TIMEOUT": "1s"})
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "cannot reach a scheduler" in proc.stderr or "but not as a Dask scheduler" in proc.stderr
    assert elapsed < 1 + FAST_S


def test_cli_tables_match_the_workflows_and_the_bench():
    from daskflow_kv import cli
    from daskflow_kv.bench import run as bench_run
    from daskflow_kv.bench import systems
    from daskflow_kv.workflows import AGENT_PARAM, WORKFLOWS

    assert cli.WORKFLOW_NAMES == tuple(WORKFLOWS)
    assert bench_run.ALL_SYSTEMS == systems.SYSTEMS + systems.OPTIONAL_SYSTEMS
    for name, build in WORKFLOWS.items():
        params = inspect.signature(build).parameters
        sizes = cli.WORKFLOW_SIZES[name]
        assert sizes["agents"] == params[AGENT_PARAM[name]].default
        for extra in ("rounds", "depth"):
            assert (extra in sizes) == (extra in params)
            if extra in params:
                assert sizes[extra] == params[extra].default
        for agents, extra in ((None, None), (3, 2)):
            kwargs = {AGENT_PARAM[name]: agents} if agents else {}
            kwargs.update({k: extra for k in ("rounds", "depth") if k in params and extra})
            flags = {k: kwargs.get(k) for k in ("rounds", "depth")}
            assert cli.agent_count(name, agents, **flags) == len(build(**kwargs).agents), (name, kwargs)


# -- the API: Engine (one process) ------------------------------------------------------------
@pytest.fixture(scope="module")
def eng():
    return make_engine("tiny-llama", block_size=16)


@pytest.fixture
def no_forward(eng, monkeypatch):
    """Any forward pass during a rejected call fails the test."""
    def tripwire(*a, **k):
        raise AssertionError("a forward pass ran before the input was checked")

    monkeypatch.setattr(eng.runner, "run", tripwire)
    return eng


@pytest.fixture(scope="module")
def states(eng):
    a = eng.materialize(CONTEXT)
    return a, eng.extend(a, eng.encode(" More."))


def _sampling(**kw):
    from daskflow_kv.model.sampling import SamplingParams

    return SamplingParams(**kw)


# (call on engine/runtime `x` with states (a, b), error type, message)
OP_CASES = [
    ("materialize str ids", lambda x, a, b: x.materialize(["39", "40"]), InvalidInputError,
     r"tokens must be integer token ids, got '39' \(str\) at position 0"),
    ("materialize float ids", lambda x, a, b: x.materialize([1.0, 2.0]), InvalidInputError,
     "integer token ids, got 1.0"),
    ("materialize bool ids", lambda x, a, b: x.materialize([True]), InvalidInputError, "integer token ids, got True"),
    ("materialize empty", lambda x, a, b: x.materialize([]), InvalidInputError, "at least one token"),
    ("materialize None", lambda x, a, b: x.materialize(None), InvalidInputError, "a sequence of token ids"),
    ("materialize out of vocab", lambda x, a, b: x.materialize([1, 2, 10**6]), InvalidInputError,
     "outside the model's vocabulary"),
    ("materialize negative id", lambda x, a, b: x.materialize([-1]), InvalidInputError,
     "outside the model's vocabulary"),
    ("generate_text float max_new", lambda x, a, b: x.generate_text([5, 6], max_new_tokens=2.5), InvalidInputError,
     "max_new_tokens must be an integer >= 1, got 2.5"),
    ("generate_text negative max_new", lambda x, a, b: x.generate_text([5, 6], max_new_tokens=-5000),
     InvalidInputError, "max_new_tokens must be an integer >= 1, got -5000"),
    ("generate_text zero max_new", lambda x, a, b: x.generate_text([5, 6], max_new_tokens=0), InvalidInputError,
     "max_new_tokens must be an integer >= 1, got 0"),
    ("generate_text str max_new", lambda x, a, b: x.generate_text([5, 6], max_new_tokens="3"), InvalidInputError,
     "max_new_tokens must be an integer"),
    ("generate_text str ids", lambda x, a, b: x.generate_text(["39"]), InvalidInputError, "integer token ids"),
    ("generate_text bad sampling", lambda x, a, b: x.generate_text([5], sampling="greedy"), InvalidInputError,
     "sampling must be a SamplingParams"),
    ("generate_text negative stream", lambda x, a, b: x.generate_text([5], stream=-1), InvalidInputError,
     "stream must be an integer >= 0"),
    ("fork 10**5", lambda x, a, b: x.fork(a, 10**5), InvalidInputError,
     r"k must be at most 1024 \(setting daskflow-kv.max-fork\), got 100000"),
    ("fork 0", lambda x, a, b: x.fork(a, 0), InvalidInputError, "k must be an integer >= 1, got 0"),
    ("fork float", lambda x, a, b: x.fork(a, 2.0), InvalidInputError, "k must be an integer >= 1, got 2.0"),
    ("fork not a state", lambda x, a, b: x.fork("root", 2), InvalidInputError, "state must be a"),
    ("merge a with a", lambda x, a, b: x.merge(a, a), InvalidInputError, "merge needs two different states"),
    ("merge bad how", lambda x, a, b: x.merge(a, b, how="sideways"), InvalidInputError,
     "how must be one of auto, concat, text, got 'sideways'"),
    ("merge not a state", lambda x, a, b: x.merge(a, None), InvalidInputError, "b must be a"),
    ("extend empty", lambda x, a, b: x.extend(a, []), InvalidInputError, "tokens must hold at least one token"),
    ("extend str ids", lambda x, a, b: x.extend(a, ["1"]), InvalidInputError, "integer token ids"),
    ("resume str ids", lambda x, a, b: x.resume(a, ["39"], max_new_tokens=2), InvalidInputError,
     "suffix must be integer token ids"),
    ("resume zero max_new", lambda x, a, b: x.resume(a, [5], max_new_tokens=0), InvalidInputError,
     "max_new_tokens must be an integer >= 1, got 0"),
    ("resume float max_new", lambda x, a, b: x.resume(a, [5], max_new_tokens=1.5), InvalidInputError,
     "max_new_tokens must be an integer >= 1, got 1.5"),
    ("resume bad sampling", lambda x, a, b: x.resume(a, [5], sampling=None), InvalidInputError,
     "sampling must be a SamplingParams"),
    ("release not a state", lambda x, a, b: x.release("s1"), InvalidInputError, "state must be a"),
]
ENGINE_ONLY = [
    ("resume_forks one string", lambda x, a, b: x.resume_forks(a, "abc"), InvalidInputError, "one string"),
    ("resume_forks limits", lambda x, a, b: x.resume_forks(a, [[5], [6]], max_new_tokens=[1]), InvalidInputError,
     "2 suffixes but 1 token limits"),
    ("resume_forks zero limit", lambda x, a, b: x.resume_forks(a, [[5], [6]], max_new_tokens=[1, 0]),
     InvalidInputError, r"max_new_tokens\[1\] must be an integer >= 1, got 0"),
    ("resume_forks too many", lambda x, a, b: x.resume_forks(a, [[5]] * 1025), InvalidInputError,
     r"len\(suffixes\) must be at most 1024"),
]
RUNTIME_ONLY = [
    ("resume_many bad policy", lambda x, a, b: x.resume_many([(a, [5])], policy="teleport"), InvalidInputError,
     "policy must be one of auto, transfer, recompute, pin"),
    ("resume_many not pairs", lambda x, a, b: x.resume_many([a]), InvalidInputError,
     r"requests\[0\] must be a \(state, suffix\) pair"),
    ("resume_many str ids", lambda x, a, b: x.resume_many([(a, [5]), (b, ["6"])]), InvalidInputError,
     r"requests\[1\] suffix must be integer token ids"),
    ("resume_many zero max_new", lambda x, a, b: x.resume_many([(a, [5])], 0), InvalidInputError,
     "max_new_tokens must be an integer >= 1, got 0"),
    ("materialize parallel 0", lambda x, a, b: x.materialize([5, 6], parallel=0), InvalidInputError,
     'parallel must be "auto" or an integer >= 1, got 0'),
    ("materialize parallel word", lambda x, a, b: x.materialize([5, 6], parallel="many"), InvalidInputError,
     'parallel must be "auto" or an integer >= 1, got \'many\''),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("name,call,error,message", OP_CASES + ENGINE_ONLY, ids=_ids(OP_CASES + ENGINE_ONLY))
def test_engine_rejects_bad_input_before_any_forward(no_forward, states, name, call, error, message):
    with pytest.raises(error, match=message):
        call(no_forward, *states)


def test_token_ids_accept_integer_arrays_and_tensors():
    assert validation.token_ids("t", np.array([1, 2, 3]), 10) == [1, 2, 3]
    assert validation.token_ids("t", torch.tensor([4, 5]), 10) == [4, 5]
    assert validation.token_ids("t", (np.int64(7),), 10) == [7]
    with pytest.raises(InvalidInputError, match="integer token ids"):
        validation.token_ids("t", np.array([1.0, 2.0]), 10)
    with pytest.raises(InvalidInputError, match="encode it first"):
        validation.token_ids("t", "39", 10)


CONSTRUCTOR_CASES = [
    ("block_size 0", {"block_size": 0}, None, "block_size must be an integer >= 1, got 0"),
    ("block_size float", {"block_size": 16.0}, None, "block_size must be an integer >= 1, got 16.0"),
    ("unknown model", {"model": "/nonexistent"}, None, "model '/nonexistent' is not a known model"),
    ("bad dtype", {"dtype": "int8"}, None, "dtype must be one of float32, bfloat16, float16, got 'int8'"),
    ("configured block size", {}, {"daskflow-kv.block-size": 0}, "setting daskflow-kv.block-size must be"),
    ("configured dtype", {}, {"daskflow-kv.dtype": "fp4"}, "setting daskflow-kv.dtype must be one of"),
]


@pytest.mark.parametrize("name,kwargs,settings,message", CONSTRUCTOR_CASES, ids=_ids(CONSTRUCTOR_CASES))
def test_engine_constructor_rejects_bad_input_before_loading(monkeypatch, name, kwargs, settings, message):
    from daskflow_kv.engine import Engine
    from daskflow_kv.model.zoo import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    with dask.config.set(settings or {}), pytest.raises(InvalidInputError, match=message):
        Engine(**{"model": "tiny-llama", **kwargs})


SAMPLING_CASES = [
    ({"temperature": -1.0}, "temperature must be a number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 1.5}, "top_k must be an integer >= 0"),
    ({"top_p": 0.0}, "top_p must be a number > 0 and <= 1"),
    ({"top_p": 1.5}, "top_p must be a number > 0 and <= 1"),
    ({"seed": "7"}, "seed must be an integer"),
]


@pytest.mark.parametrize("kwargs,message", SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_sampling_params_are_checked(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        _sampling(**kwargs)


WORKFLOW_CASES = [
    ("max_new_tokens 0", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens float", {"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
    ("reads not names", {"reads": [3]}, "reads must be a str"),
    ("instructions not text", {"instructions": None}, "instructions must be a str"),
    ("sampling not params", {"sampling": "greedy"}, "sampling must be a SamplingParams"),
    ("unknown policy", {"policy": "teleport"}, "unknown state policy"),
]


@pytest.mark.parametrize("name,kwargs,message", WORKFLOW_CASES, ids=_ids(WORKFLOW_CASES))
def test_workflow_agent_rejects_bad_input(name, kwargs, message):
    from daskflow_kv import Workflow

    wf = Workflow("w")
    wf.context("doc", "text")
    with pytest.raises(WorkflowError, match=message):
        wf.agent("a", **{"instructions": "Do it.", "reads": ["doc"], **kwargs})
    assert "a" not in wf.agents


# -- the API: KVRuntime on the shared 2-worker cluster ---------------------------------------------
@pytest.fixture(scope="module")
def rt(client):
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    return KVRuntime(client, "tiny-llama", block_size=16)


@pytest.fixture(scope="module")
def dist_states(rt):
    a = rt.materialize(rt.encode("Validation case: " + CONTEXT))
    return a, rt.extend(a, rt.encode(" More."))


@pytest.fixture
def no_cluster_work(rt, monkeypatch):
    """Any RPC or submitted task during a rejected call fails the test."""
    from daskflow_kv.runtime.plugin_client import PluginClient

    def tripwire(*a, **k):
        raise AssertionError("the scheduler was asked or a task submitted before the input was checked")

    monkeypatch.setattr(PluginClient, "call", tripwire)
    monkeypatch.setattr(rt.client, "submit", tripwire)
    return rt


@pytest.mark.parametrize("name,call,error,message", OP_CASES + RUNTIME_ONLY, ids=_ids(OP_CASES + RUNTIME_ONLY))
def test_runtime_rejects_bad_input_before_any_rpc_or_task(no_cluster_work, dist_states, name, call, error, message):
    with pytest.raises(error, match=message):
        call(no_cluster_work, *dist_states)


RUNTIME_CONSTRUCTOR_CASES = CONSTRUCTOR_CASES + [
    ("kv budget", {"kv_budget_bytes": "banana"}, None, "kv_budget_bytes must be a byte size such as 512MiB"),
    ("negative kv budget", {"kv_budget_bytes": -1}, None, "kv_budget_bytes must be a byte size such as 512MiB"),
    ("configured kv budget", {}, {"daskflow-kv.kv-budget": "banana"}, "setting daskflow-kv.kv-budget must be"),
    ("memory weight", {"memory_weight": -1}, None, "memory_weight must be a number >= 0"),
]


@pytest.mark.parametrize("name,kwargs,settings,message", RUNTIME_CONSTRUCTOR_CASES,
                         ids=_ids(RUNTIME_CONSTRUCTOR_CASES))
def test_runtime_constructor_rejects_bad_input_before_the_cluster(client, monkeypatch, name, kwargs, settings, message):
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    for attr in ("submit", "register_plugin"):
        monkeypatch.setattr(client, attr, lambda *a, **k: pytest.fail("the cluster was used first"))
    with dask.config.set(settings or {}), pytest.raises(InvalidInputError, match=message):
        KVRuntime(client, **{"model": "tiny-llama", **kwargs})


def test_runtime_stays_usable_after_rejected_calls(rt, eng):
    """Bad calls, then good ones on the same runtime: same tokens as text mode, nothing leaked."""
    tokens = rt.encode("Usable after errors: " + CONTEXT)
    for case in OP_CASES + RUNTIME_ONLY:
        root = rt.materialize(tokens)
        other = rt.extend(root, [5])
        with pytest.raises(InvalidInputError):
            case[1](rt, root, other)
        rt.release(other)
        rt.release(root)
    root = rt.materialize(tokens)
    [a, b] = rt.fork(root, 2)
    gens = rt.resume_many([(a, rt.encode(" One?")), (b, rt.encode(" Two?"))], max_new_tokens=4)
    for gen, suffix in zip(gens, (" One?", " Two?")):
        assert gen.tokens == eng.generate_text(tokens + rt.encode(suffix), max_new_tokens=4).tokens
    text = rt.generate_text(tokens, max_new_tokens=3).result()
    assert list(text.generated) == eng.generate_text(tokens, max_new_tokens=3).tokens
    for st in (a, b, root, *(g.state for g in gens)):
        rt.release(st)


def test_fork_bound_is_a_setting():
    with dask.config.set({"daskflow-kv.max-fork": 4}):
        assert validation.fork_count("k", 4) == 4
        with pytest.raises(InvalidInputError, match="at most 4"):
            validation.fork_count("k", 5)


# -- a quiet main job -------------------------------------------------------------------------------
def test_closing_an_owned_cluster_loses_no_computed_blocks():
    """embedded_runtime drops the KV blocks before the cluster closes: no 'lost' warning."""
    from daskflow_kv.runtime.cluster import embedded_runtime

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("distributed.scheduler")
    log.addHandler(handler)
    try:
        with embedded_runtime(n_workers=2, threads_per_worker=1, model="tiny-llama", block_size=16) as rt:
            root = rt.materialize(rt.encode(CONTEXT))
            [a] = rt.fork(root, 1)
            rt.resume(a, rt.encode(" Go."), max_new_tokens=2)  # continuation kept in the cache
            assert rt.catalog().num_rows > 0
    finally:
        log.removeHandler(handler)
    lost = [r.getMessage() for r in records if "caused the cluster to lose" in r.getMessage()]
    assert lost == []


def test_a_cli_run_is_quiet():
    proc, _ = _cli(["run", "rag", "--model", "tiny-llama", "--agents", "2", "--max-new-tokens", "4"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for out in (proc.stdout, proc.stderr):
        for noise in ("WARNING", "Traceback", "Loading weights", "it/s]"):
            assert noise not in out, out[-3000:]
    assert proc.stderr == ""
    assert "[state] level 2/2: synthesizer" in proc.stdout and "token agreement: 3/3" in proc.stdout
