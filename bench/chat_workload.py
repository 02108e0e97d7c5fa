"""Multi-turn chat workloads: conversations whose every turn resends the whole history.

``multi_turn_chat``: short chats that share system prompts. ``long_document_chat``: each
conversation over a long document of its own (issue 51's second workload, where recomputing a
history is expensive: 32 conversations x an 8k-token document, 4 turns of short questions and
200-token answers), so that a conversation's KV is evicted from the GPU between its turns.

Every conversation starts with one of ``num_system_prompts`` shared system prompts
(``system_len`` tokens); turn t adds a user message (``user_len`` tokens, uniform in the given
range) after the history, and the reply to it (``reply_len`` tokens) is both what the engine
generates for turn t and, as fixed synthetic tokens, what the history of turn t + 1 carries.
The history is synthetic so that both engines see the same prompts token for token (dummy
weights generate different tokens in each engine, so the real replies cannot be resent); a
prefix cache therefore reuses a conversation's previous prompt, not its previous reply.

A deterministic function of its arguments and ``seed`` (``random.Random(seed)``): the same
prompts for pagedd and vLLM (bench/bench_kv_tiers.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.workloads import W1_TOKEN_HIGH, W1_TOKEN_LOW


@dataclass(frozen=True)
class ChatTurn:
    conversation: int
    turn: int
    prompt: list[int]  # the whole history, then this turn's user message
    reply_len: int  # tokens to generate


@dataclass(frozen=True)
class ChatWorkload:
    conversations: list[list[ChatTurn]]

    @property
    def num_turns(self) -> int:
        return sum(len(c) for c in self.conversations)

    def summary(self) -> dict:
        turns = [t for c in self.conversations for t in c]
        final = [c[-1].prompt for c in self.conversations]
        return {
            "num_conversations": len(self.conversations),
            "num_requests": len(turns),
            "total_prompt_tokens": sum(len(t.prompt) for t in turns),
            "total_output_tokens": sum(t.reply_len for t in turns),
            "final_context_tokens": sum(
                len(p) + self.conversations[0][-1].reply_len for p in final
            ),
            "max_prompt_len": max(len(t.prompt) for t in turns),
        }


def multi_turn_chat(
    num_conversations: int = 48,
    num_turns: int = 5,
    *,
    system_len: int = 256,
    num_system_prompts: int = 4,
    user_len: tuple[int, int] = (256, 512),
    reply_len: int = 128,
    seed: int = 0,
    token_low: int = W1_TOKEN_LOW,
    token_high: int = W1_TOKEN_HIGH,
) -> ChatWorkload:
    if num_conversations < 1 or num_turns < 1 or num_system_prompts < 1:
        raise ValueError(
            "multi_turn_chat needs num_conversations, num_turns and num_system_prompts >= 1 "
            f"(got {num_conversations}, {num_turns}, {num_system_prompts})"
        )
    if system_len < 0 or not 1 <= user_len[0] <= user_len[1] or reply_len < 1:
        raise ValueError(
            f"multi_turn_chat needs system_len >= 0, 1 <= user_len min <= max, reply_len >= 1 "
            f"(got {system_len}, {user_len}, {reply_len})"
        )
    if not 0 <= token_low < token_high:
        raise ValueError(f"token id range [{token_low}, {token_high}) is empty or negative")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(token_low, token_high) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(num_system_prompts)]
    conversations = []
    for c in range(num_conversations):
        history = list(systems[c % num_system_prompts])
        turns = []
        for t in range(num_turns):
            history += tokens(rng.randint(*user_len))
            turns.append(ChatTurn(c, t, list(history), reply_len))
            history += tokens(reply_len)  # the synthetic reply the next turn resends
        conversations.append(turns)
    return ChatWorkload(conversations)


def long_document_chat(
    num_conversations: int = 32,
    num_turns: int = 4,
    *,
    doc_len: int = 8192,
    question_len: tuple[int, int] = (32, 64),
    reply_len: int = 200,
    seed: int = 0,
    token_low: int = W1_TOKEN_LOW,
    token_high: int = W1_TOKEN_HIGH,
) -> ChatWorkload:
    """Each conversation: its own ``doc_len``-token document, then ``num_turns`` questions
    (uniform in ``question_len``) and ``reply_len``-token answers; nothing is shared between
    conversations."""
    if num_conversations < 1 or num_turns < 1 or doc_len < 1:
        raise ValueError(
            "long_document_chat needs num_conversations, num_turns and doc_len >= 1 "
            f"(got {num_conversations}, {num_turns}, {doc_len})"
        )
    if not 1 <= question_len[0] <= question_len[1] or reply_len < 1:
        raise ValueError(
            f"long_document_chat needs 1 <= question_len min <= max and reply_len >= 1 "
            f"(got {question_len}, {reply_len})"
        )
    if not 0 <= token_low < token_high:
        raise ValueError(f"token id range [{token_low}, {token_high}) is empty or negative")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(token_low, token_high) for _ in range(n)]

    conversations = []
    for c in range(num_conversations):
        history = tokens(doc_len)
        turns = []
        for t in range(num_turns):
            history += tokens(rng.randint(*question_len))
            turns.append(ChatTurn(c, t, list(history), reply_len))
            history += tokens(reply_len)
        conversations.append(turns)
    return ChatWorkload(conversations)
