"""The plugins a KV cluster runs (installed as ``daskflow_kv.plugins``; the folder sits at
the top of the repository, as the design card has it).

Scheduler side (torch-free: ``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``):
``kv_scheduler`` (the composition root: it builds one part per concern and installs
everything below): ``kv_settings``, ``kv_events``, ``kv_tiers``, ``kv_leases``, ``kv_usage``,
``kv_budget``, ``kv_queue``, ``kv_profiles``, ``kv_locality``, ``kv_lifecycle``,
``kv_views``, ``kv_client_api``, ``tenants``, ``kv_ownership`` (who may compute a KV key;
``kv_notes``: the checked annotations), ``kv_reports`` (worker reports, from the worker
itself); and ``dashboard/`` (the dashboard's KV page and the KV series of ``/metrics``).

Worker side: ``worker`` (tensor serializers; spilled blocks and store I/O reported to the
scheduler) and ``handoff`` (the worker-to-worker channel of parallel materialize). The
scheduler imports them to install them, so what needs torch is imported in ``setup``.

May import: ``daskflow_kv.state``, ``daskflow_kv.policy``, ``daskflow_kv.keys``,
``daskflow_kv.errors``, ``daskflow_kv.config``, ``daskflow_kv.dask_internals``, distributed,
jinja2; on workers also ``daskflow_kv.store`` and ``daskflow_kv.transport``. Never the
runtime (which imports them to register them) or anything above.
"""
