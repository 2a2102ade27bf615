"""Self-distillation of a draft model from its target (docs/DISTILLATION.md).

prompts (seed corpus, Magpie prefixes, passage tasks) -> generate (the target writes user turns and
answers, batched_llama runs it fast) -> data (token-id shards) -> train (online soft labels from the
target) -> evaluate (agreement and greedy speculative acceptance per category).
"""
