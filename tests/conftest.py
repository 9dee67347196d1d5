import copy
import math
import os
import time

import dask.config
import pytest
import torch

try:  # registers its dask.config defaults on import: before any test snapshots the config
    import dask_jobqueue  # noqa: F401
except ImportError:
    pass

# Tests run on 2 cores next to Dask worker processes: keep torch from oversubscribing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _dask_config_kept():
    """Every test leaves dask.config as it found it. distributed's gen_cluster (tests/plugins/)
    resets it to the copy distributed.utils_test took on import, which lacks whatever was
    registered later (daskflow-kv's and dask-jobqueue's defaults) if nothing restored it."""
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


ARCHS = ["tiny-llama", "tiny-qwen2"]
DTYPES = ["float32", "bfloat16"]

_engines = {}


def make_engine(model="tiny-llama", dtype="float32", block_size=16, namespace=""):
    """A fresh engine (own block store) over a process-wide cached model."""
    from daskflow_kv.engine import Engine

    return Engine(model=model, dtype=dtype, block_size=block_size, namespace=namespace)


@pytest.fixture
def engine_factory():
    return make_engine


@pytest.fixture(params=[(a, d) for a in ARCHS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request):
    arch, dtype = request.param
    return make_engine(arch, dtype)


CONTEXT = (
    "The shared context is prefilled once and every agent resumes from the same key value cache. "
    "Agents debate, plan, retrieve and judge; each one reads what the others wrote."
)
SUFFIXES = [
    " Branch one asks: what is shared?",
    " Branch two: plan the next step of the workers and the scheduler.",
    " Three.",
    " Branch four wants a much longer suffix so the ragged lengths differ: tree of thought, debate, judge.",
]


def assert_same_generation(state_gen, text_gen, rtol=1e-4):
    """Exact greedy tokens; logits equal within a relative tolerance of their scale."""
    assert state_gen.tokens == text_gen.tokens
    if state_gen.logits is not None and text_gen.logits is not None:
        scale = text_gen.logits.abs().max()
        assert float((state_gen.logits - text_gen.logits).abs().max()) <= rtol * float(scale)


BATCHED_ULPS = 4  # bf16/fp16 logits of a k-row batch vs single rows (see docs/exactness.md)


def batched_logit_tolerance(logits, dtype: str) -> float:
    """How far batched-resume logits may be from a single resume's, by model dtype.

    fp32: 1e-4 of the logit scale. bf16/fp16: ``BATCHED_ULPS`` units in the last place at
    that scale: a k-row GEMM may accumulate in another order than the 1-row GEMV of a
    single decode step, and whether it does depends on the CPU's kernels (identical here
    on AVX-512/AMX; 2 ulp apart on an AVX2 AMD EPYC), so only rounding-level agreement is
    promised there; the tokens must still match exactly.
    """
    scale = float(logits.abs().max())
    if dtype == "float32":
        return 1e-4 * scale
    mantissa = {"bfloat16": 7, "float16": 10}[dtype]
    return BATCHED_ULPS * 2.0 ** (math.floor(math.log2(scale)) - mantissa)


# -- a real 2-process Dask cluster, one per test module that asks for it ------------------------
@pytest.fixture(scope="module")
def cluster():
    from daskflow_kv.runtime.cluster import local_cluster, wait_for_restarts

    with local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as c:
        yield c
        wait_for_restarts(c)  # a test killed a worker: let its nanny finish restarting before the close


@pytest.fixture(scope="module")
def client(cluster):
    from distributed import Client

    with Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def workers(client):
    from daskflow_kv.dask_internals import worker_addresses

    ws = worker_addresses(client)
    assert len(ws) == 2
    return ws


def wait_until(pred, timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes; its last answer."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def decode_busy_of_two_workers(make_worker, host_mates: bool) -> float:
    """Two modeled workers (``make_worker(i, loop)``) decode 16 tokens each at position 1000;
    the second one's busy seconds. ``host_mates``: they share a host (each steps beside the other)."""
    from daskflow_kv.sim import worker
    from daskflow_kv.sim.loop import EventLoop

    loop = EventLoop()
    ws = [make_worker(i, loop) for i in range(2)]
    if host_mates:
        ws[0].peers, ws[1].peers = (ws[1],), (ws[0],)
    for w in ws:
        w.submit(worker.Request(w.idx + 1, 0, 1000, 16, 0.0, lambda r: None))
    loop.run()
    return ws[1].busy_time
