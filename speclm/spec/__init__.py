"""Speculation itself: the draft tree type (tree), the one verifier (verify), the running batch
whose round reads propose -> score -> verify -> commit (batch), and the policy that sizes each
round's draft from measured costs (adaptive)."""
