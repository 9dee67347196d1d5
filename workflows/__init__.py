"""Runnable example workflows (installed as ``daskflow_kv.workflows``).

Each module has ``build(..., tokenizer=None) -> Workflow``; ``WORKFLOWS`` maps CLI names
to them and ``AGENT_PARAM`` names the parameter that ``--agents`` sets. ``AGENT_WORKFLOWS``
are the ones whose graph grows at run time (tools, loops, best-of-n, ReAct): how many
agents they run is known only when they end.
"""

from . import debate, debate_until, planner_solvers, rag, react_tools, tot_pruned, tree_of_thought

WORKFLOWS = {
    "tot": tree_of_thought.build,
    "debate": debate.build,
    "rag": rag.build,
    "planner": planner_solvers.build,
}
AGENT_PARAM = {"tot": "branch", "debate": "agents", "rag": "agents", "planner": "agents"}
AGENT_WORKFLOWS = {
    "react": react_tools.build,
    "debate-until": debate_until.build,
    "tot-pruned": tot_pruned.build,
}
