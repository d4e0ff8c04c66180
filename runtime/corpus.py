"""The support-chat text the load generator's workloads and the w8a8 calibration share: a
~320-token system prompt, user questions, names and plain words. Plain data, no imports
from the rest of pagedjax (the model layer reads it without reaching up into bench/)."""

from __future__ import annotations

import random

DESKS = ("Returns desk", "Shipping desk", "Warranty desk", "Trip planning desk")

# ~320 SmolLM2 tokens (checked by tests/runtime/test_bench.py against the real tokenizer
# when it is available). Shared verbatim by every shared-prefix request, by the offline
# throughput benchmark and by scripts/peer_transformers.py.
SYSTEM_PROMPT = (
    "You are Atlas, the support assistant of Northwind Outfitters, an online shop that sells "
    "hiking, camping and climbing gear. Follow these rules in every answer. First, be brief: "
    "answer in at most three short sentences unless the customer asks for detail. Second, be "
    "accurate: never invent order numbers, prices, stock levels or delivery dates; if you do "
    "not know, say so and offer to connect the customer with a human agent. Third, be safe: "
    "for questions about avalanche terrain, glacier travel, rope work or first aid, give only "
    "general guidance and recommend a certified guide or a doctor. Fourth, be polite: greet "
    "the customer by name when it is given, thank them at the end, and never argue. Store "
    "facts you may use: standard shipping takes three to five working days and is free above "
    "fifty euros; express shipping takes one to two working days and costs nine euros; "
    "returns are accepted within thirty days when the item is unused and in its original "
    "packaging; sleeping bags and boots may be exchanged for another size once at no cost; "
    "the warranty on tents, backpacks and stoves is two years and covers defects in materials "
    "and workmanship but not wear, misuse or accidents; gift cards never expire; the "
    "customer service team is reachable by chat from eight in the morning to eight in the "
    "evening on weekdays and from ten to four on Saturdays. When a customer describes a "
    "trip, suggest gear in order of importance: shelter, sleep system, clothing layers, "
    "navigation, water and food. Always write in plain English and avoid marketing language."
)

USER_TOPICS = (
    "Can I return a tent I used once?", "How long does express shipping take?",
    "Which sleeping bag should I take for a night at minus five degrees?",
    "My stove stopped working after a year. Is it covered?", "Do gift cards expire?",
    "When is your chat open on Saturday?", "What should I pack for a two day hike in the Alps?",
    "Can I exchange boots for a bigger size?", "Is shipping free for an order of sixty euros?",
    "What does the backpack warranty cover?", "I need a rope for glacier travel. Which one?",
    "How do I dry a down jacket?", "What is the best way to purify stream water?",
    "Can you tell me the status of order 12345?", "Which headlamp lasts longest?",
    "Is a three season tent enough for early spring camping?",
)
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Elif", "Femi", "Greta", "Hiro", "Ines", "Jonas", "Kai", "Lena",
         "Mateo", "Nora", "Omar", "Priya")

WORDS = tuple((
    "the of and to in is was for on that with as by at from his an were are which this be had not "
    "but one have or first new after who they more two also its been other time has only when over "
    "where there can into most three city some during would made years many later under such between "
    "known part then world these could about while may than through before four well since united "
    "school named early including around several both became however people north south river water "
    "mountain forest valley trail camp winter summer light stone bridge market garden island harbor "
    "station village road field house music story paper window"
).split())


def system_prompt(prefix_words: int | None = None) -> str:
    """SYSTEM_PROMPT, or its first `prefix_words` words (small test models, short contexts)."""
    return SYSTEM_PROMPT if prefix_words is None else " ".join(SYSTEM_PROMPT.split()[:max(1, prefix_words)])


def shared_prefix_messages(n: int, seed: int = 0, prefix_words: int | None = None,
                           prefixes: int = 1) -> list[list[dict[str, str]]]:
    """n chat conversations: SYSTEM_PROMPT + a short user message varying per request.
    prefixes > 1: that many system prompts (each opens with its own desk, so their blocks
    differ from the first one on), request i using prompt i % prefixes."""
    rng = random.Random(seed)
    base = system_prompt(prefix_words)
    systems = [base] if prefixes == 1 else [f"{DESKS[k % len(DESKS)]} {k}. {base}" for k in range(prefixes)]
    out = []
    for i in range(n):
        system = systems[i % len(systems)]
        topic = USER_TOPICS[(i + rng.randrange(len(USER_TOPICS))) % len(USER_TOPICS)]
        name = NAMES[rng.randrange(len(NAMES))]
        out.append([{"role": "system", "content": system},
                    {"role": "user", "content": f"Hi, I am {name} (ticket {1000 + i + 10000 * seed}). {topic}"}])
    return out
