"""daskflow-kv: the transformer KV cache as a first-class distributed object on Dask.

Layers, lowest first (each imports only from those before it; ``tests/test_layout.py``
checks it): ``errors``/``config`` -> ``state`` (KV descriptors, blocks, catalog) and
``policy`` (cost model, placement, eviction; pure) -> ``store`` (the persistent tier: blocks
in a directory or an fsspec URL; no Dask) -> ``model`` (forward passes over
blocks) -> ``engine`` (the operators in one process) and ``plugins`` (scheduler side) ->
``runtime`` (the operators on Dask) -> ``flow`` (workflows, compiler, executor) ->
``workflows`` (examples) -> ``bench`` -> ``cli``.

Importing the package registers the ``daskflow-kv`` settings in ``dask.config`` (as
distributed, dask-cuda and dask-jobqueue do on import), so
``dask.config.get("daskflow-kv.kv-budget")`` works right after ``import daskflow_kv``.
Everything else is lazy: the scheduler plugin imports ``daskflow_kv.policy`` and must not
pull in torch and transformers.
"""

import importlib

from . import config as _config  # noqa: F401  -- registers the defaults (dask and yaml only: cheap)

_EXPORTS = {
    "Engine": "engine",
    "Generation": "engine",
    "KVState": "state.kv_state",
    "Workflow": "flow.workflow",
    "Agent": "flow.spec",
    "Context": "flow.spec",
    "SamplingParams": "model.sampling",
    "GREEDY": "model.sampling",
    "KVRuntime": "runtime.kv_runtime",
    "DaskflowKVError": "errors",
    "IncompatibleStateError": "errors",
    "InvalidInputError": "errors",
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
