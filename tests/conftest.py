import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))

from tiny import byte_tokenizer, loaded, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def target(tok):
    return loaded(tiny_model(len(tok), seed=0), tok, name="tiny-target")


@pytest.fixture(scope="session")
def unrelated_draft(tok):
    """A draft with other random weights: almost none of its tokens are accepted."""
    return loaded(tiny_model(len(tok), seed=1, layers=1), tok, name="tiny-draft")
