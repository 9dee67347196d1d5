"""The KV page of the Dask dashboard and the KV series of ``/metrics``.

``plugin`` (the scheduler plugin and its routes), ``data`` (one snapshot of the KV
scheduler plugin), ``view`` (each section shaped for its template), ``render`` (Jinja2,
``templates/``), ``format`` (numbers for people), ``metrics`` (Prometheus); with tenants
configured, ``access`` (who sees what: anonymous totals, a tenant's own detail),
``session`` (login challenges and the signed cookie), ``login`` (the login routes) and
``request`` (what every route reads off its request). Load it with
``dask scheduler --preload daskflow_kv.plugins.dashboard``; the KV scheduler plugin also
adds it when it starts.
"""

from .plugin import KVDashboardPlugin, dask_setup

__all__ = ["KVDashboardPlugin", "dask_setup"]
