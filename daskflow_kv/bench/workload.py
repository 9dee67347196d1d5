"""The benchmark's workload: k agents that read one shared document and ask their own question.

This is the fan-out at the heart of every example workflow (RAG readers, the first level of
tree of thought, debaters of round one): a shared prompt prefix of about ``context_tokens``
tokens, then each agent's own instructions. Prompts are rendered by the project's own
``prompts.prompt_tokens`` (chat template for chat models), so every system sees exactly the
tokens a ``daskflow-kv run`` would feed.

A ``salt`` goes into the system prompt, i.e. into the first KV block: two runs with different
salts share no block, so no run is served from a cache an earlier run filled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..state.blocks import common_prefix_len
from ..flow.prompts import prompt_tokens
from ..flow.workflow import Workflow

MAX_AGENTS = 16
QUESTIONS = [
    "What does the document say about moving data between machines?",
    "Which costs grow with the length of the context?",
    "List two risks the document mentions.",
    "How would you summarize the main idea in one sentence?",
    "Which numbers appear in the document, and what do they measure?",
    "Where would a cache help most, according to the text?",
    "Name one assumption the authors make.",
    "Explain the scheduling problem in plain words.",
    "Give an example that supports the main claim.",
    "Which part would you test first, and why?",
    "Describe what happens when a worker fails.",
    "Compare recomputing with transferring.",
    "What would you measure to decide?",
    "Write a title for the document.",
    "What is left unexplained?",
    "Suggest one improvement to the design.",
]


@dataclass
class Workload:
    salt: str  # makes this run's blocks unique
    prompts: list[list[int]]  # one per agent, the whole prompt
    prefix: list[int]  # tokens every agent's prompt starts with (the shared context)
    max_new_tokens: int

    @property
    def agents(self) -> int:
        return len(self.prompts)

    @property
    def suffixes(self) -> list[list[int]]:
        return [p[len(self.prefix):] for p in self.prompts]

    @property
    def prompt_tokens(self) -> int:
        return max(len(p) for p in self.prompts)

    def primer(self) -> Workload:
        """An earlier workflow over the same shared context: the same prefix, then a token
        none of this workload's suffixes starts with, then those suffixes; one new token
        each. It caches the context (and continuations that extend no prompt of this one)."""
        firsts = {s[0] for s in self.suffixes}
        x = next(t for t in reversed(self.prefix) if t not in firsts)
        return Workload(f"{self.salt}-primer", [self.prefix + [x] + s for s in self.suffixes], list(self.prefix), 1)

    def describe(self) -> dict:
        return {"salt": self.salt, "agents": self.agents, "prefix_tokens": len(self.prefix),
                "prompt_tokens_max": self.prompt_tokens, "suffix_tokens": [len(s) for s in self.suffixes],
                "max_new_tokens": self.max_new_tokens}


def _document(tokenizer, n_tokens: int) -> str:
    from daskflow_kv.workflows.common import corpus_document

    text = corpus_document(int(n_tokens * 1.3) + 64, tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max(1, n_tokens)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _prompts(tokenizer, doc: str, salt: str) -> list[list[int]]:
    wf = Workflow("bench-fanout", system=f"Session {salt}. You answer questions about one shared document.")
    wf.context("document", doc, title="Document")
    for i in range(MAX_AGENTS):
        wf.agent(f"a{i}", f"Question {i + 1}. {QUESTIONS[i]}", reads=["document"])
    return [prompt_tokens(wf, wf.agents[f"a{i}"], {}, tokenizer) for i in range(MAX_AGENTS)]


def build_workload(tokenizer, context_tokens: int, agents: int, max_new_tokens: int, salt: str,
                   max_positions: int) -> Workload:
    """k prompts of about ``context_tokens`` tokens (whole prompt), fitting ``max_positions``."""
    if not 1 <= agents <= MAX_AGENTS:
        raise ValueError(f"agents must be 1..{MAX_AGENTS}, got {agents}")
    overhead = len(_prompts(tokenizer, "x", salt)[0])
    target = max(8, context_tokens - overhead)
    for _ in range(4):
        prompts = _prompts(tokenizer, _document(tokenizer, target), salt)
        longest = max(len(p) for p in prompts)
        over = longest + max_new_tokens - max_positions
        if over <= 0:
            break
        target -= over + 8
    else:
        raise ValueError(f"cannot fit a {context_tokens}-token context into {max_positions} positions")
    n = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
    n = min(n, min(len(p) for p in prompts) - 1)  # every agent feeds at least one token of its own
    return Workload(salt, prompts[:agents], list(prompts[0][:n]), max_new_tokens)

