"""A model's forward as speculation needs it: the rows of cached keys and values and their
lengths (cache), which forward runs and its timing (runner), speclm's own forward for the
architectures it knows (lean, attention, embedding), prompts' cached prefixes (prefix_cache) and
what a forward costs on this machine by tokens read (costs)."""
