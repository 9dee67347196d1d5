"""``Workflow``: the workflow description plus the things a user does with it: compile,
run, draw, and look at it in a notebook.

The compiler and the executor only read a ``WorkflowSpec``; this class sits above both,
so the dependency points one way (spec <- compiler/executor <- Workflow).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import config, validation
from ..errors import WorkflowError
from . import html_repr, progress as progress_bar, steps as steps_
from .compiler import CompiledWorkflow, agent_levels, compile_workflow
from .executor import run_workflow
from .operators import Corpus, MemoryKey, bm25_search, memory_read, memory_write
from .spec import Agent, Context, Tool, WorkflowSpec, name_tuple
from .steps import Step, ToolCall

__all__ = ["Agent", "Context", "Step", "Tool", "ToolCall", "Workflow", "tokenizer_and_limit"]


def tokenizer_and_limit(model: str | None = None):
    """``model``'s tokenizer and position limit (default: setting ``daskflow-kv.model``),
    loaded in this process: enough to compile a workflow without a cluster or the weights."""
    from ..model.zoo.loader import load_tokenizer, resolve_model_path
    from ..model.zoo.names import check_model, max_positions

    model = check_model(config.get("model", model), "model")
    limit = max_positions(model)
    if limit is None:  # a hub model or a directory without the field at its top: ask transformers
        from transformers import AutoConfig

        limit = AutoConfig.from_pretrained(resolve_model_path(model)).max_position_embeddings
    return load_tokenizer(model), limit


@dataclass(slots=True)
class Workflow(WorkflowSpec):
    # -- operators beside the agents (``Workflow.tool`` is the spec's) ---------------------------
    def retrieve(self, name: str, corpus: Corpus, reads=(), k: int = 3, title: str = "", **options) -> str:
        """The ``k`` best passages of ``corpus`` (``operators.Corpus``: a file every worker reads,
        or passages scattered once) for the texts of ``reads`` joined as one query (BM25)."""
        validation.instance("corpus", corpus, Corpus)
        k = validation.integer("k", k, minimum=1, maximum=100)
        return self.tool(name, bm25_search, reads, args=(corpus, k), kind="retrieve", title=title or name, **options)

    def remember(self, name: str, key: str, reads, store: str = "default", **options) -> str:
        """Write the texts of ``reads`` (joined) under ``key`` of memory ``store``; later runs
        read it back (``recall``). Its output is what it wrote."""
        validation.instance("key", key, str)
        validation.instance("store", store, str)
        return self.tool(name, memory_write, reads, args=(MemoryKey(store, key),), kind="memory", **options)

    def recall(self, name: str, key: str, default: str = "", store: str = "default", **options) -> str:
        """What memory ``store`` holds under ``key`` (``default`` when nothing was written),
        read after this workflow's own writes of that key."""
        validation.instance("key", key, str)
        validation.instance("default", default, str)
        mk = MemoryKey(store, key)
        writes = tuple(t.name for t in self.tools.values() if t.fn is memory_write and t.args[:1] == (mk,))
        after = writes + tuple(options.pop("after", ()))
        return self.tool(name, memory_read, (), args=(mk, default), after=after, kind="memory", **options)

    # -- parts decided at run time -------------------------------------------------------------
    def step(self, step: Step) -> str:
        """Add a ``steps.Step``: a plan that adds agents and tools as the run reaches it."""
        validation.instance("step", step, Step)
        self._new_name(step.name)
        name_tuple(f"step {step.name!r}:", "reads", step.reads)
        self.steps[step.name] = step
        return step.name

    def loop(self, name: str, body: Callable, until: Callable[[str], bool], max_rounds: int, reads=()) -> str:
        """Rounds until ``until(output)`` holds, at most ``max_rounds`` (``steps.loop``)."""
        return self.step(steps_.loop(name, body, until, max_rounds, reads))

    def best_of(self, name: str, candidate: Callable, n: int, score, keep: int = 1, reads=()) -> str:
        """The best ``keep`` of ``n`` candidates by ``score`` (a function or a scoring agent's
        instructions; ``steps.best_of``)."""
        return self.step(steps_.best_of(name, candidate, n, score, keep, reads))

    def beam(self, name: str, expand: Callable, width: int, keep: int, depth: int, score, reads=()) -> str:
        """Expand, score and prune ``depth`` times, keeping ``keep`` (``steps.beam``)."""
        return self.step(steps_.beam(name, expand, width, keep, depth, score, reads))

    def react(self, name: str, instructions: str, tools: Mapping[str, Callable], reads=(), max_steps: int = 4,
              propose: Callable[[int, str], ToolCall | None] | None = None, max_new_tokens: int = 48,
              **tool_options) -> str:
        """An agent that calls ``tools`` and continues its own conversation with each result
        (``steps.react``); ``tool_options``: ``tool`` keywords for every call."""
        return self.step(steps_.react(name, instructions, tools, reads, max_steps, propose, max_new_tokens,
                                      tool_options=tool_options))

    # -- running ------------------------------------------------------------------------------
    def compile(self, tokenizer, max_positions: int, block_size: int | None = None) -> CompiledWorkflow:
        block_size = validation.setting("block-size", block_size, "block_size", validation.block_size)
        max_positions = validation.integer("max_positions", max_positions, minimum=1)
        return compile_workflow(self, tokenizer, max_positions, block_size)

    def run(self, mode: str = "state", runtime=None, progress: bool | None = None, **runtime_kwargs):
        """Run on ``runtime`` (a KVRuntime), or on an embedded local cluster.

        ``progress``: a bar over the agents (tqdm.auto: a widget in a notebook, text on a
        terminal); None shows it in a notebook, on a terminal or with ``daskflow-kv.verbose``,
        and nowhere else (logs and pipes stay clean)."""
        validation.choice("mode", mode, ("state", "text", "both"))
        bar = progress_bar.for_run(len(self.agents), mode, progress)
        if bar is None:
            return run_workflow(self, mode=mode, runtime=runtime, **runtime_kwargs)
        try:
            result = run_workflow(self, mode=mode, runtime=runtime, progress=bar, **runtime_kwargs)
        except BaseException:
            bar.close(done=False)
            raise
        bar.close()
        return result

    # -- looking at it ------------------------------------------------------------------------
    def visualize(self, filename: str | None = None, format: str = "svg", result=None, runtime=None,
                  model: str | None = None, block_size: int | None = None):
        """Draw the stateful graph G_s with graphviz, as ``dask.visualize`` draws a task graph.

        ``filename`` (its extension, if any, chooses the format) is written; without one the
        drawing is returned (an IPython SVG/Image in a notebook). ``format``: svg, png, pdf,
        jpeg, or dot (the DOT source, the one format that needs no Graphviz ``dot`` program).

        Which G_s: a run's, when ``result`` (a ``WorkflowResult`` or ``Comparison``) is given -
        its groups as found at run time, and where each agent ran, its plan and what it
        reused; else compiled for ``runtime`` (a KVRuntime); else for ``model`` (default
        ``daskflow-kv.model``), whose tokenizer is loaded here (no cluster).
        """
        run = getattr(result, "state", result)
        if run is not None and getattr(run, "graph", None) is not None:
            cw = run.graph
        elif runtime is not None:
            cw = self.compile(runtime.tokenizer, runtime.facts.max_positions, block_size or runtime.block_size)
        else:
            tokenizer, limit = tokenizer_and_limit(model)
            cw = self.compile(tokenizer, limit, block_size)
        return cw.visualize(filename, format, result=result)

    def _repr_html_(self) -> str:
        try:
            return html_repr.workflow_html(self, agent_levels(self))
        except WorkflowError as e:  # a spec still being written shows what is wrong with it
            return html_repr.workflow_html(self, None, str(e))
