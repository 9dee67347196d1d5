"""Dask plugins of daskflow-kv, installed as ``daskflow_kv.plugins``."""
