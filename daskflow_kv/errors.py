"""Errors raised when reuse cannot be proven safe. Each says what differs, never just 'invalid'."""

from __future__ import annotations


class DaskflowKVError(Exception):
    """Base class for every error daskflow-kv raises on purpose."""


class InvalidInputError(DaskflowKVError, ValueError):
    """An argument, CLI flag or setting is malformed or out of range (``daskflow_kv.validation``).

    Raised before any cluster starts, model loads or task is submitted; the message is one
    line naming the input, what it must be and what it was.
    """


class IncompatibleStateError(DaskflowKVError):
    """A KV state was used with a model, tokenizer, dtype or position it was not made for."""

    def __init__(self, what: str, differences: list[str]):
        self.differences = differences  # one "field: ours != theirs" line per mismatch
        super().__init__(f"{what}: " + "; ".join(differences))


class MergeError(IncompatibleStateError):
    """Two states cannot be combined exactly (divergent, non-contiguous or unrelated)."""


class StateReleasedError(DaskflowKVError):
    """The state (or one of its blocks) was released or evicted and is no longer held."""


class ContextTooLongError(DaskflowKVError):
    """Prompt plus generation would run past the model's maximum positions."""


class WorkflowError(InvalidInputError):
    """A workflow spec is malformed (cycle, unknown agent, missing context, ...)."""


class ToolFailed(DaskflowKVError, RuntimeError):
    """A workflow's tool raised (its exception is ``__cause__``, as a Dask future's result
    raises it). Raised once every branch that did not depend on the tool had finished:
    ``result`` holds their outputs (a ``WorkflowResult``), their KV stays cached."""

    def __init__(self, tool: str, message: str, result=None):
        super().__init__(message)
        self.tool = tool  # the tool's name in the workflow
        self.result = result  # the run up to the failure


class KVBudgetError(DaskflowKVError):
    """A task would take a worker's KV past its budget and nothing evictable makes room."""


class KVPreempted(KVBudgetError):
    """Waiting KV tasks held each other's room and nothing ran: the budget failed the youngest
    so the older ones can go on (vLLM's preemption). Release its states and try it again
    (the workflow executor does)."""


class SchedulerLost(DaskflowKVError, ConnectionError):
    """The scheduler this runtime talks to is gone (killed, its machine lost, the network cut):
    the call failed instead of waiting. Its KV lived on the cluster; a new cluster over the
    same persistent store reads what was stored instead of prefilling it again."""


class ClientClosed(DaskflowKVError, RuntimeError):
    """The runtime's Dask client was closed while a call still needed it (a thread outlived
    the ``with Client(...)`` block): nothing was sent."""


class OpenSchedulerError(InvalidInputError):
    """A client holds a tenant's secret but the scheduler has no tenants: it would act as an admin
    of one shared trust domain (``daskflow-kv.open-scheduler: warn`` allows it)."""
