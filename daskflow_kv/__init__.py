"""daskflow-kv: the transformer KV cache as a first-class distributed object on Dask."""

from .engine import Engine, Generation
from .errors import (
    ContextTooLongError,
    DaskflowKVError,
    IncompatibleStateError,
    MergeError,
    StateReleasedError,
    WorkflowError,
)
from .kv_state import KVState
from .sampling import GREEDY, SamplingParams
from .workflow import Agent, Context, Workflow

__all__ = [
    "Engine",
    "Generation",
    "KVState",
    "Workflow",
    "Agent",
    "Context",
    "SamplingParams",
    "GREEDY",
    "DaskflowKVError",
    "IncompatibleStateError",
    "MergeError",
    "StateReleasedError",
    "ContextTooLongError",
    "WorkflowError",
]
__version__ = "0.1.0"
