"""``Workflow``: the workflow description plus the two things a user does with it.

The compiler and the executor only read a ``WorkflowSpec``; this class sits above both,
so the dependency points one way (spec <- compiler/executor <- Workflow).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import config
from .compiler import CompiledWorkflow, compile_workflow
from .executor import run_workflow
from .spec import Agent, Context, WorkflowSpec

__all__ = ["Agent", "Context", "Workflow"]


@dataclass(slots=True)
class Workflow(WorkflowSpec):
    # -- running ------------------------------------------------------------------------------
    def compile(self, tokenizer, max_positions: int, block_size: int | None = None) -> CompiledWorkflow:
        return compile_workflow(self, tokenizer, max_positions, config.get("block-size", block_size))

    def run(self, mode: str = "state", runtime=None, **runtime_kwargs):
        """Run on ``runtime`` (a KVRuntime), or on an embedded local cluster."""
        return run_workflow(self, mode=mode, runtime=runtime, **runtime_kwargs)
