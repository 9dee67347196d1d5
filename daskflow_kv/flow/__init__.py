"""The workflow layer: agents and contexts in, a stateful graph and its results out.

Owns: the workflow description (``spec``) and its API (``workflow.Workflow``), prompt
rendering (``prompts``), the compiler to the stateful graph G_s (``compiler``), the
executor that lowers G_s onto a runtime in state and text mode (``executor``), and BM25
retrieval (``retrieval``).

May import: ``daskflow_kv.state``, ``daskflow_kv.model`` (sampling settings) and
``daskflow_kv.runtime`` (an embedded cluster when none is given). The dependency inside
points one way: spec <- prompts <- compiler <- executor <- workflow.
"""
