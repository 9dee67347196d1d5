"""resume_many batches the branches of one state that land on one worker (one prefill_batch task).

Real LocalCluster of 2 worker processes; tiny-llama, block_size=16. The tokens must equal the
per-branch path (``batch=False``) and text mode; below fp32 branches resume one by one
(a k-row decode rounds unlike one branch's) and match text mode bit for bit.
"""

import gc
import time

import pytest
import torch
from conftest import CONTEXT, SUFFIXES, make_engine, wait_until

from daskflow_kv.keys import PREFILL_TOPIC
from daskflow_kv.runtime import tasks
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.model.sampling import SamplingParams

EVENTS = "daskflow-kv"
NEW = 6
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)


_RUNTIMES = {}


def _rt(client, dtype):
    if dtype not in _RUNTIMES:
        _RUNTIMES[dtype] = KVRuntime(client, "tiny-llama", dtype=dtype, block_size=16)
    return _RUNTIMES[dtype]


def _events(client, topic, since):
    return [m for t, m in client.get_events(topic) if t >= since and isinstance(m, dict)]



def _tasks_run(client, since, op="resume"):
    """Keys of the resume compute tasks the plugin placed since ``since``."""
    return [m["key"] for m in _events(client, EVENTS, since) if m.get("op") == op + "-task" and
            str(m.get("key", "")).startswith(f"kvprefill-{op}-")]


@pytest.mark.parametrize("dtype", ["float32"])  # below fp32: see the per-branch test below
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_pinned_branches_run_as_one_batch(client, workers, dtype, sampling):
    a, _ = workers
    rt = _rt(client, dtype)
    engine = make_engine("tiny-llama", dtype, block_size=16)
    ctx = rt.encode(f"Batched {dtype} {sampling.greedy}: " + CONTEXT)
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    kids = rt.fork(root, 4)
    sufs = [rt.encode(s) for s in SUFFIXES]
    reqs = list(zip(kids, sufs))

    t0 = time.time()
    gens = rt.resume_many(reqs, max_new_tokens=NEW, sampling=sampling, policy="pin", return_logits=True)
    t1 = time.time()
    plain = rt.resume_many(reqs, max_new_tokens=NEW, sampling=sampling, policy="pin", return_logits=True,
                           batch=False)

    # Exactly one prefill_batch task for the 4 branches; the unbatched call ran 4 plain prefills.
    assert wait_until(lambda: len(_tasks_run(client, t0)) >= 5)
    batched_keys = [k for k in _tasks_run(client, t0) if k.startswith("kvprefill-resume-batch-")]
    plain_keys = [k for k in _tasks_run(client, t1) if not k.startswith("kvprefill-resume-batch-")]
    assert len(batched_keys) == 1 and len(plain_keys) == 4, (batched_keys, plain_keys)
    assert not [k for k in _tasks_run(client, t0) if k in {f"kvprefill-resume-{g.state.state_id}" for g in gens}]
    # One timing event for the batch, counting every branch's suffix.
    assert wait_until(lambda: any(m.get("branches") == 4 for m in _events(client, PREFILL_TOPIC, t0)))
    [ev] = [m for m in _events(client, PREFILL_TOPIC, t0) if m.get("branches")]
    assert ev["new_tokens"] == sum(len(s) for s in sufs) and ev["worker"] == a
    assert list(ev["state_ids"]) == [g.state.state_id for g in gens]

    for i, (g, p, s) in enumerate(zip(gens, plain, sufs)):
        assert g.worker == p.worker == a and g.placement.action == "reuse"
        assert g.tokens == p.tokens and g.text == p.text
        assert float((g.logits - p.logits).abs().max()) <= 1e-2 * float(p.logits.abs().max())
        # Same continuation state: same content-addressed block keys as the per-branch path.
        assert g.state.state.block_keys == p.state.state.block_keys
        assert list(g.state.tokens) == ctx + s + g.tokens[:-1]
        assert g.metrics["tokens_reused"] == len(ctx) and g.metrics["tokens_computed"] == len(s)
        want = engine.generate_text(ctx + s, max_new_tokens=NEW, sampling=sampling, stream=i)
        assert g.tokens == want.tokens
    rt.wait([g.state for g in gens])
    assert all(set(ws) == {a} for g in gens for k, ws in g.state.who_has().items()
               if k not in root.state.block_keys)
    # A continuation built by the batch resumes like any other state.
    more = [gens[0].tokens[-1]] + rt.encode(" And then?")
    g2 = rt.resume(gens[0].state, more, max_new_tokens=NEW)
    assert g2.tokens == engine.generate_text(list(gens[0].state.tokens) + more, NEW).tokens


def test_below_fp32_branches_resume_one_by_one_and_bit_exactly(client, workers):
    a, _ = workers
    rt = _rt(client, "bfloat16")
    engine = make_engine("tiny-llama", "bfloat16", block_size=16)
    ctx = rt.encode("Per-branch bf16: " + CONTEXT)
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    sufs = [rt.encode(s) for s in SUFFIXES]
    t0 = time.time()
    gens = rt.resume_many(list(zip(rt.fork(root, len(sufs)), sufs)), max_new_tokens=NEW, policy="pin",
                          return_logits=True)
    assert wait_until(lambda: len(_tasks_run(client, t0)) >= len(sufs))
    assert not [k for k in _tasks_run(client, t0) if k.startswith("kvprefill-resume-batch-")]
    for g, s in zip(gens, sufs):
        want = engine.generate_text(ctx + s, max_new_tokens=NEW, return_logits=True)
        assert g.tokens == want.tokens and torch.equal(g.logits, want.logits)


def test_batch_outputs_are_released_and_mixed_placements(client, workers):
    """Branches split over two workers: a batch per worker (or a plain prefill for a lone one); no leaks."""
    a, b = workers
    rt = _rt(client, "float32")
    root = rt.materialize(rt.encode("Batched leaks: " + CONTEXT), worker=a)
    kids = rt.fork(root, 3)
    t0 = time.time()
    gens = rt.resume_many([(k, rt.encode(" Go.")) for k in kids[:2]], max_new_tokens=2, policy="pin")
    gens += rt.resume_many([(kids[2], rt.encode(" Go."))], max_new_tokens=2, policy="transfer", workers=[b])
    assert [g.worker for g in gens] == [a, a, b]
    assert wait_until(lambda: len(_tasks_run(client, t0)) >= 2)
    keys = _tasks_run(client, t0)
    assert sum(k.startswith("kvprefill-resume-batch-") for k in keys) == 1
    assert any(k.startswith(f"kvprefill-resume-{gens[2].state.state_id}-") for k in keys)  # + a random tail
    rt.wait([g.state for g in gens])

    def intermediates(dask_scheduler):
        return sorted(k for k, ts in dask_scheduler.tasks.items()
                      if str(k).startswith(("kvprefill-", "kvresult-", "kvreplica-")) and ts.state == "memory")

    # A future caught in a reference cycle goes at the next collection, not at once.
    assert wait_until(lambda: gc.collect() >= 0 and not client.run_on_scheduler(intermediates)), \
        client.run_on_scheduler(intermediates)


def test_sizeof_batch_output():
    from dask.sizeof import sizeof

    spec = tasks.ModelSpec("tiny-llama", block_size=16)
    root = tasks.prefill(spec, tasks.PrefillRequest(tuple(range(3, 40)), 0))
    reqs = tuple(tasks.PrefillRequest(tuple(range(3, 40)) + (50 + i,), 37, 2, stream=i, state_id=f"s{i}")
                 for i in range(3))
    out = tasks.prefill_batch(spec, tasks.BatchPrefillRequest(reqs, 37), *root.blocks)
    assert len(out.outputs) == 3 and out.stats["branches"] == 3
    tensor_bytes = sum(b.numel() * b.element_size() for o in out.outputs for b in o.blocks)
    assert tensor_bytes > 0 and sizeof(out) >= tensor_bytes
    for i, r in enumerate(reqs):
        single = tasks.prefill(spec, r, *root.blocks)
        branch = tasks.take_branch(out, i)
        assert branch.generated == single.generated and branch.spans == single.spans
