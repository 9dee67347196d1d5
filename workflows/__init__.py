"""Runnable example workflows, installed as ``daskflow_kv.workflows``."""
