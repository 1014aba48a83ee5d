"""The decoding methods' names and the defaults the CLI shows (no torch import: the CLI parses
its arguments before loading anything)."""

METHODS = ("none", "draft", "pld", "draft+pld")
DRAFT_METHODS = ("draft", "draft+pld")  # methods that run a draft model
# draft+pld drafts a row by lookup when at least this many trailing tokens recur in its context
DRAFT_LOOKUP_NGRAM_MIN = 2
# draft+pld leaves the draft model off for prompts longer than this times max_new_tokens
DRAFT_PROMPT_RATIO = 3.0
