import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))
# Tests write models and quantized weights into a store of their own, never the user's cache
# (subprocesses inherit it); a test that needs another sets SPECLM_HOME itself.
os.environ["SPECLM_HOME"] = tempfile.mkdtemp(prefix="speclm-tests-")
atexit.register(shutil.rmtree, os.environ["SPECLM_HOME"], True)

from tiny import byte_tokenizer, loaded, tiny_model, word_tokenizer  # noqa: E402


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


def save(model, tokenizer, folder):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Tiny models saved as model folders, for the command line."""
    root = tmp_path_factory.mktemp("models")
    tok = byte_tokenizer()
    return {
        "target": save(tiny_model(len(tok), seed=0), tok, root / "target"),
        "draft": save(tiny_model(len(tok), seed=1, layers=1), tok, root / "draft"),
        "other_vocab": save(tiny_model(40, seed=2), word_tokenizer(40), root / "other"),
    }


@pytest.fixture
def engine(target, unrelated_draft):
    from speclm import SpecEngine

    return SpecEngine(target, draft=unrelated_draft)


@pytest.fixture
def dataset(tmp_path):
    """Short prompts in three categories (a JSON-lines file, as users pass with --dataset)."""
    path = tmp_path / "prompts.jsonl"
    rows = [("qa", "who wrote it? who wrote it?"), ("rag", "the cat sat. the cat"), ("translation", "Hallo Welt, Hallo")]
    path.write_text("\n".join(json.dumps({"id": i, "category": c, "prompt": p}) for i, (c, p) in enumerate(rows)) + "\n")
    return str(path)
