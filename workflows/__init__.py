"""Runnable example workflows (installed as ``daskflow_kv.workflows``).

Each module has ``build(..., tokenizer=None) -> Workflow``; ``WORKFLOWS`` maps CLI names
to them and ``AGENT_PARAM`` names the parameter that ``--agents`` sets.
"""

from . import debate, planner_solvers, rag, tree_of_thought

WORKFLOWS = {
    "tot": tree_of_thought.build,
    "debate": debate.build,
    "rag": rag.build,
    "planner": planner_solvers.build,
}
AGENT_PARAM = {"tot": "branch", "debate": "agents", "rag": "agents", "planner": "agents"}
