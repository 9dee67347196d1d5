"""daskflow-kv: the transformer KV cache as a first-class distributed object on Dask.

Exports are lazy: ``import daskflow_kv.cost_model`` (the scheduler plugin does) must not pull
in torch and transformers.
"""

import importlib

_EXPORTS = {
    "Engine": "engine",
    "Generation": "engine",
    "KVState": "kv_state",
    "Workflow": "workflow",
    "Agent": "workflow",
    "Context": "workflow",
    "SamplingParams": "sampling",
    "GREEDY": "sampling",
    "DaskflowKVError": "errors",
    "IncompatibleStateError": "errors",
    "MergeError": "errors",
    "StateReleasedError": "errors",
    "ContextTooLongError": "errors",
    "WorkflowError": "errors",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'daskflow_kv' has no attribute {name!r}")
