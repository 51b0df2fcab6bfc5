"""What the agreement checks (cpu-dtype, kv-fp8) ask and how they compare: the twenty chat prompts
run greedy under two settings, and how many leading tokens two answers share."""

from __future__ import annotations

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "How do I reverse a list in Python?", "Give three tips for better sleep.", "What causes rain?",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?", "Name five fruits that are red.",
    "Why is the sky blue?", "Describe a cat to someone who has never seen one.", "What is a prime number?",
    "Translate 'good morning' into Spanish and German.", "List the planets of the solar system.",
    "How does a refrigerator keep food cold?", "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "How many days are in a leap year?", "What does a compiler do?",
]


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
