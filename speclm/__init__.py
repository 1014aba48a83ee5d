"""speclm: lossless speculative decoding for Hugging Face transformers models.

    import speclm
    speclm.set_threads()  # one torch thread per usable core
    speclm.keep_freed_memory()  # glibc keeps freed memory: no page faults refilling it
    target = speclm.load_model("qwen2.5-coder-1.5b", quantize="int8")
    draft = speclm.load_model("qwen2.5-coder-0.5b", quantize="int4")  # a draft's weights can be coarser
    engine = speclm.SpecEngine(target, draft=draft)
    out = engine.generate("Write a haiku about caches.", method="draft", chat=True)
    print(out.text, out.stats.mean_accepted_tokens)
"""

from speclm.round.batch import Batch
from speclm.methods import NAMES as METHODS
from speclm.engine import Completion, GenerationOptions, SpecEngine, TextStream
from speclm.requests import Request
from speclm.errors import PullError, SpeclmError, UsageError
from speclm.models import LoadedModel, load_model, pull
from speclm.quant.weights import QUANTIZE_MODES, quantize_model
from speclm.runtime import keep_freed_memory, set_threads
from speclm.sampling import SamplingParams
from speclm.stats import RequestStats

__version__ = "0.1.0"

__all__ = [
    "METHODS", "Completion", "GenerationOptions", "SpecEngine", "TextStream", "Batch", "Request",
    "PullError", "SpeclmError", "UsageError",
    "LoadedModel", "load_model", "pull", "SamplingParams", "RequestStats",
    "QUANTIZE_MODES", "quantize_model", "set_threads", "keep_freed_memory",
]
