"""Tree of thought with pruning: expand each kept thought ``branch`` ways, score, keep ``keep``.

Every thought continues its parent's conversation (``follows``); a scoring agent continues
each candidate's conversation to rate it (or ``score``, a function of the text, does), and
only the best ``keep`` are expanded further (``Workflow.beam``). Pruned branches are let
go; kept ones are extended by their next turn only. The evaluator reads what survived.
"""

from __future__ import annotations

from daskflow_kv.flow.workflow import Workflow

from .common import corpus_document

PROBLEM = ("A team must serve many agents that share long documents on a small cluster. Decide how to "
           "place the shared key value cache, when to move it, and when to recompute it.")
RATE = "Rate that approach from 1 (poor) to 10 (excellent). Answer with the number only."


def build(branch: int = 3, keep: int = 1, depth: int = 2, context_tokens: int = 256, max_new_tokens: int = 24,
          tokenizer=None, score=RATE, name: str = "tot_pruned", document: str | None = None) -> Workflow:
    """``score``: a scoring agent's instructions, or a function of a thought's text;
    ``document``: the material under the problem (default: corpus passages)."""
    wf = Workflow(name, system="You reason step by step and keep each step short.")
    wf.context("problem", PROBLEM + "\n" + (document or corpus_document(context_tokens, tokenizer)), title="Problem")

    def expand(g, d, parent, i):
        if parent is None:
            return g.agent(f"tot.{i}", f"Propose approach number {i + 1} in one sentence.", reads=["problem"],
                           max_new_tokens=max_new_tokens)
        return g.agent(f"{parent}.{i}", f"Refine that approach: give concrete step {i + 1}.", follows=parent,
                       max_new_tokens=max_new_tokens)

    wf.beam("tot", expand, width=branch, keep=keep, depth=depth, score=score, reads=["problem"])
    wf.agent("evaluator", "Which line of thought is most promising? Answer with its name and one reason.",
             reads=["problem", "tot"], max_new_tokens=max_new_tokens)
    return wf
