"""The workflow layer: agents and contexts in, a stateful graph and its results out.

Owns: the workflow description (``spec``) and its API (``workflow.Workflow``), prompt
rendering (``prompts``), the compiler to the stateful graph G_s (``compiler``), the
executor that lowers G_s onto a runtime in state and text mode (``executor``), and BM25
retrieval (``retrieval``). Beside the agents: tools, retrieval and memory as Dask tasks
(``tool_calls``, ``operators``), parts of the graph decided at run time (``steps``: loops,
best-of-n, ReAct), the run that grows as they decide (``growing``), and the KV of a
conversation while its tool runs (``kv_wait``).

May import: ``daskflow_kv.state``, ``daskflow_kv.model`` (sampling settings),
``daskflow_kv.runtime`` (an embedded cluster when none is given) and ``dask_internals``
(which workers have a tool's resources). The dependency inside points one way:
spec <- prompts <- compiler <- steps/tool_calls <- kv_wait <- growing <- executor <- workflow.
"""
