"""Render an agent's prompt from what it reads, in an order that makes prefixes shareable.

Every agent's prompt is: system, then what it reads (contexts and upstream outputs, in the
order given), then its role and instructions last. Agents that read the same things in
the same order therefore share a token prefix up to their own instructions, and a debate
round's prompt begins with the previous round's. Both modes (text and state) build
prompts here, from text, so they feed the model identical tokens.

An agent that ``follows`` another continues that agent's conversation: its prompt is the
other's prompt, the other's answer, then a new user turn - so it begins with exactly the
tokens of the other's continuation state, and resumes from it instead of re-prefilling.

Chat models get their chat template; models without one get a plain layout with the same
order and the same prefix property.

A tool's output (``Workflow.tool``: a search, a calculation, a memory) is read like a
context, under its title; a step's (a loop, best-of-n, ReAct) like an agent's answer.
"""

from __future__ import annotations

from typing import Mapping

from .spec import Agent, WorkflowSpec


def render_body(wf: WorkflowSpec, agent: Agent, outputs: Mapping[str, str]) -> str:
    parts = []
    for name in agent.reads:
        if name in wf.contexts:
            ctx = wf.contexts[name]
            parts.append(f"## {ctx.title or ctx.name}\n{ctx.text.strip()}")
        elif name in wf.tools:  # a tool's, a search's or a memory's output: text like a context
            parts.append(f"## {wf.tools[name].title or name}\n{outputs[name].strip()}")
        else:  # an agent's output, or a step's (``flow.steps``: what it settled on)
            parts.append(f"## {name} said\n{outputs[name].strip()}")
    task = f"You are {agent.role}. {agent.instructions}" if agent.role else agent.instructions
    parts.append(f"## Task\n{task.strip()}")
    return "\n\n".join(parts)


def messages(wf: WorkflowSpec, agent: Agent, outputs: Mapping[str, str]) -> list[dict]:
    if agent.follows:
        msgs = messages(wf, wf.agents[agent.follows], outputs)
        msgs.append({"role": "assistant", "content": outputs[agent.follows]})
    else:
        msgs = [{"role": "system", "content": wf.system}]
    msgs.append({"role": "user", "content": render_body(wf, agent, outputs)})
    return msgs


def render_prompt(wf: WorkflowSpec, agent: Agent, outputs: Mapping[str, str], tokenizer) -> str:
    msgs = messages(wf, agent, outputs)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    text = msgs[0]["content"]
    for m in msgs[1:]:
        text += f"\n\n{m['content']}\n\n## Answer\n" if m["role"] == "user" else m["content"]
    return text


def prompt_tokens(wf: WorkflowSpec, agent: Agent, outputs: Mapping[str, str], tokenizer) -> list[int]:
    text = render_prompt(wf, agent, outputs, tokenizer)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
