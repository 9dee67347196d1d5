"""Issue 22, item 5, and issue 51, item 3: the second tenant takes the whole KV budget.

Without a share per tenant, bob pinning enough blocks evicts alice's cache and makes her
next prefill fail with ``KVBudgetError``. With quotas (``daskflow-kv.tenants.<name>.quota``,
KV bytes per worker guaranteed to the tenant) bob's tasks may not fill the part of alice's
quota she does not hold yet, nor evict her blocks below it: his extra prefill fails with a
message naming the quotas, alice's cached prefix stays, her next prefill is admitted and
her resume gives text mode's tokens. One worker, so every block competes for one budget.

Issue 51: usage counted every KV output but admission saw only annotated tasks and trusted
their ``kv_out``, so bob took the same 80 KiB admission refused him as a task claiming
``kv_out=0`` and one without an annotation. Now a task under a KV-holding key declares its
bytes or is cut from an output it shares, and a result over what was declared is refused
before the scheduler takes it. With no quotas configured each tenant keeps a fair share, so
bob's pinned blocks neither evict alice's cache nor get her next prefill preempted.
"""

from __future__ import annotations

import random

import dask
import pytest

from conftest import wait_until

from daskflow_kv.errors import KVBudgetError
from daskflow_kv.keys import PREFILL, REPLICA, block_key, task_key
from daskflow_kv.plugins.tenants import AccessDenied
from tenancy_kit import TENANTS, cluster_fixture, compute_note, scheduler_state, tenant, tenant_cluster, text_tokens

BYTES_PER_TOKEN = 512  # tiny-llama's K/V bytes per token (checked below)
TOKENS = 32  # every prompt here: two whole blocks
X = TOKENS * BYTES_PER_TOKEN  # one prompt's K/V
QUOTA, BUDGET = 3 * X, 25 * X // 4  # a quarter of X spare: each block's Python object counts a few bytes
QUOTAS = {name: {**spec, "quota": QUOTA} for name, spec in TENANTS.items() if name in ("alice", "bob")}
QUOTAS["ops"] = {**TENANTS["ops"], "quota": 0}  # none (without a quota it would get a fair share of the rest)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(TOKENS)]


@pytest.fixture(scope="module")
def cluster():
    with tenant_cluster(QUOTAS, n_workers=1, **{"kv-budget": BUDGET, "scheduler.admission-patience": "2s"}) as c:
        yield c


alice = tenant("alice", QUOTAS)
bob = tenant("bob", QUOTAS)


def test_bob_pinning_blocks_neither_evicts_alices_cache_nor_fails_her_prefill(alice, bob):
    assert alice.facts.bytes_per_token == BYTES_PER_TOKEN  # the sizes above
    cached = alice.materialize(_prompt(0))
    alice.wait([cached])
    keys = list(cached.state.block_keys)
    alice.release(cached)  # cached, not pinned: what the budget could evict

    pinned = []
    for seed in range(1, 4):  # three fit beside alice's unused quota
        pinned.append(bob.materialize(_prompt(100 + seed)))
        bob.wait(pinned[-1:])
        assert [f.status for f in pinned[-1].futures] == ["finished"] * 2
    extra = bob.materialize(_prompt(200))  # a fourth would take what alice's quota keeps for her
    with pytest.raises(KVBudgetError, match="quotas"):
        extra.futures[0].result(timeout=60)
    assert all(scheduler_state(alice.client, k) == "memory" for k in keys)  # her cache stayed

    fresh = _prompt(1000)
    state = alice.materialize(fresh)  # admitted: her quota was kept for her
    alice.wait([state])
    assert all(f.status == "finished" for f in state.futures)
    again = alice.materialize(_prompt(0))
    assert again.state.lineage[-1].as_dict()["tokens_computed"] == 0  # her cached prefix, reused
    suffix = _prompt(2000)[:6]
    gen = alice.resume(state, suffix, max_new_tokens=4)
    assert gen.tokens == text_tokens(alice, fresh + suffix, 4)
    for s in pinned:
        bob.release(s)
    alice.release_many([state, again])


def test_a_tenant_without_a_quota_is_guaranteed_a_fair_share():
    from daskflow_kv.plugins.tenants import TenantRegistry

    budget = [None]
    quotas = TenantRegistry(TENANTS).quotas(lambda: budget[0])
    assert dict(quotas) == {}  # no budget, nothing to share
    budget[0] = 900
    assert dict(quotas) == {"alice": 300, "bob": 300, "ops": 300}
    mixed = TenantRegistry({**TENANTS, "alice": {**TENANTS["alice"], "quota": 600},
                            "ops": {**TENANTS["ops"], "quota": 0}}).quotas(lambda: budget[0])
    assert dict(mixed) == {"alice": 600, "bob": 300}  # the rest of the budget for bob; ops opted out
    budget[0] = 1200  # the admin changed the budget: the shares follow
    assert dict(mixed) == {"alice": 600, "bob": 600}


def test_preemption_respects_other_tenants_quota_floors():
    """A stuck line of alice's preempts bob's run only while bob holds more than his quota there."""
    from daskflow_kv.plugins.kv_budget import Held, _may_preempt_for

    def unit(namespace):
        return [("key", None, Held(None, 0, namespace, 0.0, flow="run"))]

    line = ("tcp://w", "alice")
    assert not _may_preempt_for(unit("bob"), line, over=set())  # bob within his quota: kept
    assert _may_preempt_for(unit("bob"), line, over={"bob"})  # bob over it: his excess may go
    assert _may_preempt_for(unit("alice"), line, over=set())  # her own younger runs, as before
    assert _may_preempt_for(unit("bob"), ("tcp://w", None), over=set())  # no quotas: lines are not per tenant


def test_quotas_are_checked_when_the_scheduler_starts():
    from daskflow_kv.plugins.tenants import TenantRegistry

    assert TenantRegistry(QUOTAS).quotas() == {"alice": QUOTA, "bob": QUOTA}
    with pytest.raises(ValueError, match="quota"):
        TenantRegistry({"alice": {"secret": "s", "quota": "lots"}})


# -- issue 51, item 3: quotas taken around admission ------------------------------------------------
def _fresh(nbytes: int, *inputs):
    """What bob's task returns: ``nbytes`` of new tensor (K/V as far as the budget can tell)."""
    import torch

    return torch.zeros(nbytes // 4, dtype=torch.float32)


def _gone(client, key) -> bool:
    """Neither the scheduler nor any worker holds a value under ``key``."""
    held = client.run(lambda dask_worker: key in dask_worker.data)
    return not any(held.values()) and scheduler_state(client, key) in (None, "erred")


def test_kv_taken_around_admission_is_refused(alice, bob):
    """The same 80 KiB admission refused bob, as a task claiming kv_out=0, as a task with no
    annotation, as a block claiming 8 bytes, and as cuts of a small output holding more than it."""
    honest = bob.materialize(_prompt(300) * 5)  # 160 tokens: 80 KiB, more than alice's quota leaves him
    with pytest.raises(KVBudgetError, match="quotas"):
        honest.futures[0].result(timeout=60)
    with dask.annotate(kv=compute_note(kv_out=0)):
        claimed = bob.client.submit(_fresh, 80 << 10, key=task_key(PREFILL, "bob", "claims-0"), pure=False)
    with pytest.raises(KVBudgetError, match="declared 0.0 KiB of KV and its result holds 80.1 KiB") as e:
        claimed.result(timeout=60)
    assert "\n" not in str(e.value)
    unannotated = bob.client.submit(_fresh, 80 << 10, key=task_key(PREFILL, "bob", "plain"), pure=False)
    with pytest.raises(AccessDenied, match="declares the KV it adds"):
        unannotated.result(timeout=30)
    key = block_key(f"{7:032x}", "bob")
    meta = {"key": key, "start": 0, "end": 1, "nbytes": 8, "tokens": [5], "parent": None, "fingerprint": "f",
            "state_id": "kvstate-x-000000000001"}
    with dask.annotate(kv={"role": "block", "meta": meta}):
        block = bob.client.submit(_fresh, 80 << 10, key=key, pure=False)
    with pytest.raises(KVBudgetError, match="declared 0.0 KiB"):
        block.result(timeout=60)
    with dask.annotate(kv=compute_note(kv_out=8 << 10)):  # an honest 8 KiB output ...
        source = bob.client.submit(_fresh, 8 << 10, key=task_key(PREFILL, "bob", "source"), pure=False)
    cuts = [bob.client.submit(_fresh, 8 << 10, source, key=task_key(REPLICA, "bob", "cut", i), pure=False)
            for i in range(3)]  # ... and three cuts of it, each holding as much new
    outcomes = []
    for c in cuts:
        try:
            outcomes.append(c.result(timeout=60) is not None)
        except KVBudgetError as e:
            outcomes.append(str(e))
    assert outcomes.count(True) == 1 and all("is cut from KV outputs holding" in o for o in outcomes if o is not True)
    for f in (claimed, block, *[c for c, o in zip(cuts, outcomes) if o is not True]):
        assert wait_until(lambda f=f: _gone(bob.client, f.key))  # refused results were freed on the worker
    del source, cuts

    fresh = _prompt(3000)
    state = alice.materialize(fresh)  # admitted in her quota, as before any of it
    alice.wait([state])
    gen = alice.resume(state, _prompt(3001)[:5], max_new_tokens=4)
    assert gen.tokens == text_tokens(alice, fresh + _prompt(3001)[:5], 4)
    alice.release(state)


# -- no quotas configured: a fair share each ---------------------------------------------------------
SHARED_BUDGET = 25 * X // 4  # three tenants without a quota: a third each (2.08 prompts)


fair = cluster_fixture(TENANTS, "fair", n_workers=1,
                       **{"kv-budget": SHARED_BUDGET, "scheduler.admission-patience": "2s"})
alice_fair = tenant("alice", cluster="fair", name="alice_fair")
bob_fair = tenant("bob", cluster="fair", name="bob_fair")


def test_without_quotas_bobs_pinned_blocks_neither_evict_alices_cache_nor_preempt_her(alice_fair, bob_fair):
    alice, bob = alice_fair, bob_fair
    cached = alice.materialize(_prompt(10))
    alice.wait([cached])
    alice.release(cached)  # cached, not pinned
    pinned = [bob.materialize(_prompt(20 + i)) for i in range(2)]  # his fair share, pinned
    bob.wait(pinned)
    more = bob.materialize(_prompt(30))  # past his share: it waits for room of his own (and never gets it)
    fresh = _prompt(40)
    state = alice.materialize(fresh)  # admitted in her share: no wait, no KVPreempted
    alice.wait([state])
    again = alice.materialize(_prompt(10))
    assert again.state.lineage[-1].as_dict()["tokens_computed"] == 0  # her cache stayed
    alice.release(again)  # her share holds two prompts: her resume may evict her own cache
    gen = alice.resume(state, _prompt(41)[:5], max_new_tokens=4)
    assert gen.tokens == text_tokens(alice, fresh + _prompt(41)[:5], 4)
    assert more.futures[0].status != "finished"
    for s in pinned:
        bob.release(s)
