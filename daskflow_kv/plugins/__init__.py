"""Scheduler-side plugins: the KV catalog, locality, retention and eviction
(``kv_scheduler``), and the dashboard's KV page with its Prometheus series
(``kv_dashboard``, ``kv_metrics``).

They run inside the Dask scheduler (``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``)
and must stay light: no torch, no transformers.

May import: ``daskflow_kv.state``, ``daskflow_kv.policy``, ``daskflow_kv.errors``,
``daskflow_kv.config``, distributed, and jinja2 (the KV page's templates, in ``templates/``).
Never the runtime (which imports them to register them) or anything above.
"""
