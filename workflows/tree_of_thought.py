"""Tree of thought: expand ``branch`` thoughts per node for ``depth`` levels, then evaluate.

Every thought continues its parent's conversation (``follows``), so siblings share the
parent's whole prompt and answer: the parent's continuation state is reused, and only the
new user turn is prefilled, once per sibling group. The evaluator reads all leaves (a
text-level merge of divergent branches).
"""

from __future__ import annotations

from daskflow_kv.flow.workflow import Workflow

from .common import corpus_document

PROBLEM = (
    "A team must serve many agents that share long documents on a small cluster. Decide how to "
    "place the shared key value cache, when to move it, and when to recompute it."
)


def build(branch: int = 2, depth: int = 2, context_tokens: int = 256, max_new_tokens: int = 24, tokenizer=None) -> Workflow:
    wf = Workflow("tree_of_thought", system="You reason step by step and keep each step short.")
    wf.context("problem", PROBLEM + "\n" + corpus_document(context_tokens, tokenizer), title="Problem")
    frontier = [None]
    for level in range(depth):
        nxt = []
        for parent in frontier:
            for i in range(branch):
                name = f"t{level}_{i}" if parent is None else f"{parent}.{i}"
                if parent is None:
                    wf.agent(name, f"Propose approach number {i + 1} in one sentence.", reads=["problem"],
                             max_new_tokens=max_new_tokens)
                else:
                    wf.agent(name, f"Refine that approach: give concrete step {i + 1}.", follows=parent,
                             max_new_tokens=max_new_tokens)
                nxt.append(name)
        frontier = nxt
    wf.agent("evaluator", "Which line of thought is most promising? Answer with its name and one reason.",
             reads=["problem", *frontier], merge="text", max_new_tokens=max_new_tokens)
    return wf
