"""ReAct with two tools: a calculator and a BM25 search over the shipped corpus.

The agent reads the question, writes ``Action: tool[input]`` lines, and each observation
comes back as a new turn of its own conversation (``Workflow.react``): its KV is extended
by the observation only, never prefilled again. The search's corpus is the shipped
JSON-lines file, read and indexed once by each worker that runs a search.
"""

from __future__ import annotations

import ast
import operator

from daskflow_kv.flow.operators import Corpus, Search
from daskflow_kv.flow.workflow import Workflow

from .common import CORPUS_PATH, corpus_document
from .tool_latency import Latency, Slow

QUESTION = ("SmolLM2-135M keeps 30 layers of 3 key-value heads of 64 numbers each, for keys and for values, "
            "in 4-byte floats. How many KV bytes does one token take, and when is moving it cheaper than "
            "recomputing it?")
EXAMPLE = ("Example:\nAction: calculator[30 * 3 * 64 * 2 * 4]\nObservation: 46080\n"
           "Action: search[transfer or recompute]\nObservation: ...\nFinal Answer: ...")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_POWER = 64  # exponents above this are refused (a model can ask for 9**9**9)


def calculator(expression: str) -> str:
    """Arithmetic on numbers (+ - * / // % **, parentheses); anything else is answered with
    an error line, as a tool answers a bad call: the agent reads it and goes on."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {type(e).__name__}: {e}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent {right} is over {MAX_POWER}")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


def tools(latency: Latency | None = None) -> dict:
    """The two tools, each delayed by ``latency`` when given (EMULATED external latency)."""
    found = {"calculator": calculator, "search": Search(Corpus.from_file(CORPUS_PATH), k=2)}
    return found if latency is None else {n: Slow(fn, latency) for n, fn in found.items()}


def build(question: str = QUESTION, max_steps: int = 4, context_tokens: int = 128, max_new_tokens: int = 32,
          tokenizer=None, propose=None, latency: Latency | None = None, name: str = "react",
          document: str | None = None) -> Workflow:
    """``propose(step, text)``: which call the agent's output makes (default: parsed from it).
    ``document``: the background the agent reads (default: corpus passages)."""
    wf = Workflow(name, system="You answer questions by calling tools. Be brief.")
    wf.context("background", document or corpus_document(context_tokens, tokenizer, start=9), title="Background")
    wf.context("question", question, title="Question")
    wf.react("agent", f"Answer the question.\n{EXAMPLE}", tools(latency), reads=["background", "question"],
             max_steps=max_steps, propose=propose, max_new_tokens=max_new_tokens)
    return wf
