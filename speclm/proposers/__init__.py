"""Proposers: everything that drafts tokens for the one verifier."""

from speclm.proposers.base import Draft, Proposer, Verified
from speclm.proposers.draft_model import DraftModelProposer
from speclm.proposers.draft_lookup import DraftLookupProposer
from speclm.proposers.prompt_lookup import PromptLookupProposer, lookup

__all__ = ["Draft", "Proposer", "Verified", "DraftModelProposer", "DraftLookupProposer", "PromptLookupProposer", "lookup"]
