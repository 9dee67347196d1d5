"""Issue 22, item 5: the second tenant takes the whole KV budget.

Without a share per tenant, bob pinning enough blocks evicts alice's cache and makes her
next prefill fail with ``KVBudgetError``. With quotas (``daskflow-kv.tenants.<name>.quota``,
KV bytes per worker guaranteed to the tenant) bob's tasks may not fill the part of alice's
quota she does not hold yet, nor evict her blocks below it: his extra prefill fails with a
message naming the quotas, alice's cached prefix stays, her next prefill is admitted and
her resume gives text mode's tokens. One worker, so every block competes for one budget.
"""

from __future__ import annotations

import random

import pytest

from daskflow_kv.errors import KVBudgetError
from tenancy_kit import TENANTS, scheduler_state, tenant, tenant_cluster, text_tokens

BYTES_PER_TOKEN = 512  # tiny-llama's K/V bytes per token (checked below)
TOKENS = 32  # every prompt here: two whole blocks
X = TOKENS * BYTES_PER_TOKEN  # one prompt's K/V
QUOTA, BUDGET = 3 * X, 25 * X // 4  # a quarter of X spare: each block's Python object counts a few bytes
QUOTAS = {name: {**spec, "quota": QUOTA} for name, spec in TENANTS.items() if name in ("alice", "bob")}
QUOTAS["ops"] = TENANTS["ops"]


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


def test_quotas_are_checked_when_the_scheduler_starts():
    from daskflow_kv.plugins.tenants import TenantRegistry

    assert TenantRegistry(QUOTAS).quotas() == {"alice": QUOTA, "bob": QUOTA}
    with pytest.raises(ValueError, match="quota"):
        TenantRegistry({"alice": {"secret": "s", "quota": "lots"}})
