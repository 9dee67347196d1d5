"""``Workflow``: the workflow description plus the two things a user does with it.

The compiler and the executor only read a ``WorkflowSpec``; this class sits above both,
so the dependency points one way (spec <- compiler/executor <- Workflow).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import validation
from .compiler import CompiledWorkflow, compile_workflow
from .executor import run_workflow
from .spec import Agent, Context, WorkflowSpec

__all__ = ["Agent", "Context", "Workflow"]


@dataclass(slots=True)
class Workflow(WorkflowSpec):
    # -- running ------------------------------------------------------------------------------
    def compile(self, tokenizer, max_positions: int, block_size: int | None = None) -> CompiledWorkflow:
        block_size = validation.setting("block-size", block_size, "block_size", validation.block_size)
        max_positions = validation.integer("max_positions", max_positions, minimum=1)
        return compile_workflow(self, tokenizer, max_positions, block_size)

    def run(self, mode: str = "state", runtime=None, **runtime_kwargs):
        """Run on ``runtime`` (a KVRuntime), or on an embedded local cluster."""
        return run_workflow(self, mode=mode, runtime=runtime, **runtime_kwargs)
