"""Issue 51: nothing lost for the honest tenant while the second one attacks.

Alice runs her workflows - a shared context materialized, branches resumed from it, a
follow-up that reuses her cache - while bob, on other clients of the same scheduler, plays
every attack of issue 51 over and over: logins naming her client, annotations holding
``10**400``, a graph no worker message can carry, KV taken around admission (a task claiming
``kv_out=0``, one with no annotation), the admin's stolen token, live states and probed
links by the thousand, squats under her keys. Every attack is refused, and every one of her
workflows completes with text mode's tokens. A real 2-worker cluster under a KV budget,
tenants as in ``tests/test_tenancy.py`` (no quotas: the fair share each).
"""

from __future__ import annotations

import itertools
import threading
import time

import dask
from distributed import Client

from daskflow_kv.errors import KVBudgetError
from daskflow_kv.keys import BIND_OP, PREFILL, RESULT, task_key
from daskflow_kv.plugins.tenants import AccessDenied, login_proof
from tenancy_kit import PROMPT, TENANTS, compute_note, plugin, runtime, tenant_cluster, text_tokens

BUDGET = 1 << 20  # KV bytes per worker: admission and quotas at work, room for alice's share


def _fresh(nbytes: int):
    import torch

    return torch.zeros(nbytes // 4, dtype=torch.float32)


def _attacks(cluster, victim_client: str, admin_token: str):
    """Bob's moves: each returns when it was defeated, and raises when it was not."""
    registry = plugin(cluster).tenants
    bob = runtime(cluster, "bob")
    mallory = Client(cluster)
    counter = itertools.count()

    async def login_naming_alice(client):
        nonce = await client.scheduler.kv_challenge()
        client._send_to_scheduler({"op": BIND_OP, "nonce": nonce, "client": victim_client})
        await client.scheduler.kv_login(namespace="bob", nonce=nonce,
                                        proof=login_proof(TENANTS["bob"]["secret"], nonce, "bob"))

    def logs_nobody_out():  # bob logs in as himself (he may), naming her client: hers is untouched
        mallory.sync(login_naming_alice, mallory)
        assert registry.sessions_of(victim_client) == 1

    def submit(client, fn, *args, annotate=None, **kw):
        with dask.annotate(**(annotate or {})):
            return client.submit(fn, *args, pure=False, **kw).result(timeout=60)

    moves = {name: (lambda move=move: _refused(move)) for name, move in {
        "10**400 in a note": lambda: submit(bob.client, len, b"x", key=task_key(PREFILL, "bob", next(counter)),
                                            annotate={"kv": compute_note(predicted_s=10 ** 400)}),
        "a squat under alice's key": lambda: submit(mallory, len, b"x", key=task_key(RESULT, "alice", next(counter))),
        "a graph no worker can be sent": lambda: submit(mallory, len, b"x", key=f"plain-{next(counter)}",
                                                        annotate={"foo": 10 ** 400}),
        "kv_out=0 holding 256 KiB": lambda: submit(bob.client, _fresh, 256 << 10,
                                                   key=task_key(PREFILL, "bob", next(counter)),
                                                   annotate={"kv": compute_note()}),
        "KV with no annotation": lambda: submit(bob.client, _fresh, 256 << 10,
                                                key=task_key(PREFILL, "bob", next(counter))),
        "the admin's token": lambda: mallory.sync(mallory.scheduler.kv_configure, session=admin_token,
                                                  kv_budget_bytes=1),
        "states past the bound": lambda: bob.plugin.register_states(
            [{"state_id": f"kvstate-flood-{next(counter):012x}", "block_keys": []} for _ in range(20000)]),
        "probes of made-up links": lambda: bob.plugin.record_bandwidth(f"tcp://10.9.9.9:{next(counter)}",
                                                                      "tcp://10.9.9.8:1", 1e9),
    }.items()}
    moves["logins naming alice's client"] = logs_nobody_out
    return moves, (bob, mallory)


def _refused(move) -> None:
    """``move`` was refused with one of the plugin's answers; anything else is an attack that worked."""
    try:
        move()
    except (AccessDenied, KVBudgetError, ValueError):
        return
    raise AssertionError("not refused")


def test_alices_workflows_complete_exactly_while_bob_attacks():
    with tenant_cluster(**{"kv-budget": BUDGET}) as cluster:
        alice, ops = runtime(cluster, "alice"), runtime(cluster, "ops")
        moves, held = _attacks(cluster, alice.client.id, ops.session.token)
        stop, done, unrefused = threading.Event(), [], []

        def attack():
            while not stop.is_set():
                for name, move in moves.items():
                    try:
                        move()
                    except Exception as e:  # noqa: BLE001 -- an attack that worked, or broke something
                        unrefused.append(f"{name}: {e!r}")
                    else:
                        done.append(name)

        bob_thread = threading.Thread(target=attack, daemon=True)
        bob_thread.start()
        try:
            context = alice.encode(PROMPT)
            for round_ in range(3):  # her workflows: a context, three branches from it, a follow-up
                shared = alice.materialize(context)
                branches = [alice.encode(f" Question {round_}.{i}: what follows?") for i in range(3)]
                gens = alice.resume_many([(shared, b) for b in branches], max_new_tokens=5)
                for b, gen in zip(branches, gens):
                    assert gen.tokens == text_tokens(alice, context + b, 5)
                if round_:  # the context came from her cache: bob's attacks evicted nothing of it
                    assert shared.state.lineage[-1].as_dict()["tokens_computed"] == 0
                alice.release(shared)
            deadline = time.time() + 120
            while set(done) | {u.split(":")[0] for u in unrefused} < set(moves) and time.time() < deadline:
                bob_thread.join(0.5)  # every move played at least once
        finally:
            stop.set()
            bob_thread.join(120)
            for rt in (alice, ops, held[0]):
                rt.client.close()
            held[1].close()
    assert not unrefused, unrefused
    assert set(done) == set(moves)
