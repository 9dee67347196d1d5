"""The KV scheduler plugin's knobs, in one typed object its parts share.

Read from ``dask.config["daskflow-kv"]`` (see ``daskflow-kv.yaml``) when the plugin is
made, where an argument is left at None; the admin's ``kv_configure`` changes the budget
and the memory weight while the cluster runs, ``kv_gate_configure`` the workflow gate. Parts
read a field when they decide, so a change applies to the next decision without telling
each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from daskflow_kv import config, validation


@dataclass(slots=True)
class KVSettings:
    kv_budget_bytes: int | None  # KV bytes each worker may hold in memory; None = unbounded
    memory_weight: float  # lambda: seconds the planner charges per KV byte placed
    evict_interval: float  # s between the plugin's periodic checks (budget, leases, orphans)
    lease_seconds: float  # s a looked-up block is kept from eviction, until its reader holds it
    admission_patience: float  # s a parked task waits with no progress anywhere, then fails
    reuse_hint: float  # s a released state's blocks announced for reuse are evicted last
    prefill_samples: int  # prefill timings kept per worker for the profile fit
    session_ttl: float  # s a session lives unused
    register_wait: float  # s kv_register_states waits for its blocks' tasks to arrive
    workflow_gate: float | None  # running workflow runs per worker at most (None: no limit; kv_gate)

    @classmethod
    def from_config(cls, kv_budget_bytes: int | str | None = None, memory_weight: float | None = None,
                    evict_interval: float | str | None = None,
                    lease_seconds: float | str | None = None) -> KVSettings:
        """The settings, each argument left at None taken from dask.config."""
        return cls(
            kv_budget_bytes=config.get_bytes("kv-budget", kv_budget_bytes),
            memory_weight=config.get("memory-weight", memory_weight),
            evict_interval=config.get_seconds("scheduler.evict-interval", evict_interval),
            lease_seconds=config.get_seconds("scheduler.lease", lease_seconds),
            admission_patience=config.get_seconds("scheduler.admission-patience"),
            reuse_hint=config.get_seconds("scheduler.reuse-hint"),
            prefill_samples=int(config.get("scheduler.prefill-samples")),
            session_ttl=config.get_seconds("scheduler.session-ttl"),
            register_wait=config.get_seconds("scheduler.register-wait"),
            workflow_gate=validation.setting("scheduler.workflow-gate", None, "workflow_gate", validation.optional,
                                             validation.number, above=0),
        )
