"""Other CPU engines as `bench` methods: llama.cpp and OpenVINO GenAI, on the same prompts.

A user who wants faster local decoding on a CPU would pick one of these instead of speclm, so
the bench runs them beside it, each from the same source weights and the same prompt token ids:

- `llama.cpp`, `llama.cpp-pld[:k=N,ngram_max=N]`: llama.cpp through llama-cpp-python (its pip
  package builds llama.cpp from source for this CPU) on the model's GGUF file itself: for the
  catalog's models the Q4_K_M file that speclm de-quantizes, run natively. Prompt lookup is
  llama-cpp-python's `LlamaPromptLookupDecoding`.
- `openvino`, `openvino-draft[:k=N]`, `openvino-pld[:k=N,ngram_max=N]`: OpenVINO GenAI's
  `LLMPipeline` on the models exported by optimum-intel from the same weights (int8 weights for
  the target and int4 for the draft by default, as speclm's; `weights=int4|int8|fp16` changes
  it), with a draft model or prompt lookup. Activations in f32 by default (`precision=f32|bf16|auto`;
  auto: OpenVINO's own choice, bf16 on CPUs with AMX, which ran it slower there).

Each peer runs at the settings its own project recommends for a CPU unless the method says
otherwise (`PEER_DEFAULTS`, shown in the report), uses this process's thread count, and keeps
its own cache of the previous prompt as its engine does. A peer's speculative outputs are
compared token for token with the same engine's plain decoding (`PLAIN`): its own lossless count.

Both engines are an optional extra (`pip install speclm[peers]`, or `make peers`). optimum-intel
pins an older transformers than speclm's, so the export runs in an environment of its own: the
`optimum-cli` on PATH, or the one `SPECLM_OPTIMUM_CLI` names (`make peers` builds it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from speclm.errors import UsageError

LLAMA_CPP = ("llama.cpp", "llama.cpp-pld")
OPENVINO = ("openvino", "openvino-draft", "openvino-pld")
PEER_METHODS = LLAMA_CPP + OPENVINO
PLAIN = {m: ("llama.cpp" if m in LLAMA_CPP else "openvino") for m in PEER_METHODS}  # each one's own plain decoding

# Each project's own recommended settings, where the method does not set them:
# - llama-cpp-python's README: "num_pred_tokens is the number of tokens to predict 10 is the default and
#   generally good for gpu, 2 performs better for cpu-only machines"; max_ngram_size 2 is its default.
# - OpenVINO GenAI's speculative-decoding and prompt-lookup samples: num_assistant_tokens 5, max_ngram_size 3.
# - OpenVINO's weights: int8 target and int4 draft, as speclm's default pair.
# - OpenVINO's activations: f32 (INFERENCE_PRECISION_HINT), not its default where the CPU has AMX (bf16):
#   on a 2-core AMX Xeon f32 decoded 1.5-1.7x faster (benchmarks/amx/records.md#openvino-precision).
PEER_DEFAULTS = {
    "llama.cpp-pld": {"k": 2, "ngram_max": 2},
    "openvino": {"weights": "int8", "precision": "f32"},
    "openvino-draft": {"k": 5, "weights": "int8", "draft_weights": "int4", "precision": "f32"},
    "openvino-pld": {"k": 5, "ngram_max": 3, "weights": "int8", "precision": "f32"},
}
OPENVINO_WEIGHTS = ("int8", "int4", "fp16")
OPENVINO_CHOICES = {"weights": OPENVINO_WEIGHTS, "draft_weights": OPENVINO_WEIGHTS, "precision": ("f32", "bf16", "auto")}
OPENVINO_OPTIONS = tuple(OPENVINO_CHOICES)  # options of the openvino methods alone
INSTALL_HINT = "pip install 'speclm[peers]' (or make peers)"


def settings(name: str, options: dict) -> dict:
    """The method's options over its project's defaults."""
    return {**PEER_DEFAULTS.get(name, {}), **options}


def describe(name: str, options: dict, engine=None) -> str:
    """One line for the report: what ran, at which settings (with what `engine`, the loaded peer, had to change)."""
    s = settings(name, options)
    caveat = f"; {engine.caveat}" if getattr(engine, "caveat", None) else ""
    if name == "llama.cpp":
        return "llama.cpp (llama-cpp-python), plain decoding on the GGUF file" + caveat
    if name == "llama.cpp-pld":
        return (f"llama.cpp prompt lookup (LlamaPromptLookupDecoding), num_pred_tokens {s['k']}, max_ngram_size {s['ngram_max']}"
                + caveat)
    weights = f"target weights {s['weights']}, activations {s['precision']}"
    if name == "openvino":
        return f"OpenVINO GenAI LLMPipeline, plain decoding, {weights}"
    if name == "openvino-draft":
        return (f"OpenVINO GenAI speculative decoding, num_assistant_tokens {s['k']}, {weights}, "
                f"draft weights {s['draft_weights']}")
    return f"OpenVINO GenAI prompt lookup, num_assistant_tokens {s['k']}, max_ngram_size {s['ngram_max']}, {weights}"


def check(name: str, options: dict) -> None:
    """The method's options and its engine's package, before anything is loaded."""
    for key, choices in OPENVINO_CHOICES.items():
        if key in options and options[key] not in choices:
            raise UsageError(f"{key} must be one of {', '.join(choices)} in method '{name}'")
    bad = set(options) - {"k", "ngram_max"} - (set(OPENVINO_OPTIONS) if name in OPENVINO else set())
    if bad:
        raise UsageError(f"method {name} takes no option {', '.join(sorted(bad))}")
    module = "llama_cpp" if name in LLAMA_CPP else "openvino_genai"
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"method {name} needs the {module} package: {INSTALL_HINT}") from None


# llama.cpp's AMX kernels (its extra buffer type on CPUs with AMX) ended the process with an
# invalid-opcode trap at their first tile instruction on a Linux Xeon with AMX, even with the tile
# permission granted. A trap cannot be caught, so a child process runs them first on the same file.
_AMX_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, n_threads=int(sys.argv[2]), verbose=False)
prompt = llm.tokenize(b"def add(a, b):\\n    return a + b\\n\\nprint(add(1, 2), add(3, 4))\\n" * 2)
for _, _ in zip(range(2), llm.generate(prompt, temp=0.0, top_k=1)):  # a batched prefill, then one-token steps
    pass
"""
AMX_CAVEAT = "extra buffer types off (its AMX kernels trapped on this machine in a trial process)"


def _has_amx_kernels() -> bool:
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


@functools.lru_cache(maxsize=None)
def llama_cpp_amx_traps(gguf: str, threads: int) -> bool:
    """Whether llama.cpp, as built here with AMX kernels, dies by a signal running `gguf` (in a child
    process). False where it has no AMX kernels, and where the child fails otherwise: the peer's own
    load then reports that failure as usual."""
    if not _has_amx_kernels():
        return False
    try:
        done = subprocess.run([sys.executable, "-c", _AMX_PROBE, gguf, str(threads)], capture_output=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise UsageError(f"llama.cpp's trial run of its AMX kernels on {gguf} did not end in 15 minutes") from None
    return done.returncode < 0


@contextlib.contextmanager
def _without_extra_buffer_types():
    """Llama() loads its model with use_extra_bufts off (its repacked and AMX layouts; llama-cpp-python
    passes no argument for it, so its default parameters are wrapped while the model loads)."""
    import llama_cpp.llama_cpp as lib

    if "use_extra_bufts" not in dict(lib.llama_model_params._fields_):
        raise UsageError("llama.cpp's AMX kernels trap on this machine and this llama-cpp-python cannot turn them off: "
                         "rebuild it without them (CMAKE_ARGS=\"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                         "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
                         "pip install --no-cache-dir --force-reinstall llama-cpp-python)")
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppPeer:
    """llama.cpp on a GGUF file; with `k`, its prompt-lookup speculative decoding. Where its AMX
    kernels trap on this machine it runs without extra buffer types, and `caveat` says so."""

    def __init__(self, gguf: Path, name: str, options: dict, n_ctx: int, threads: int, eos: tuple[int, ...]):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        s = settings(name, options)
        draft = LlamaPromptLookupDecoding(max_ngram_size=s["ngram_max"], num_pred_tokens=s["k"]) if name == "llama.cpp-pld" else None
        self.eos = set(eos)
        # logits_all with a draft: llama-cpp-python verifies drafts from every position's logits, but sizes that
        # buffer by its logits_all argument alone (n_batch rows), so a context past 512 tokens overran it
        self.caveat = AMX_CAVEAT if llama_cpp_amx_traps(str(gguf), threads) else None
        with _without_extra_buffer_types() if self.caveat else contextlib.nullcontext():
            self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                             draft_model=draft, logits_all=draft is not None, verbose=bool(os.environ.get("SPECLM_PEER_VERBOSE")))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> list[int]:
        if temperature > 0:
            self.llm.set_seed(seed)
            params = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0)
        else:
            params = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)  # llama.cpp's greedy sampler
        out: list[int] = []
        for token in self.llm.generate(prompt_ids, repeat_penalty=1.0, **params):
            if token in self.eos:
                break
            out.append(token)
            if len(out) == max_new_tokens:
                break
        return out


class OpenVINOPeer:
    """OpenVINO GenAI's LLMPipeline; with a draft model or prompt lookup, its speculative decoding."""

    def __init__(self, target_folder: Path, draft_folder: Path | None, name: str, options: dict, threads: int,
                 eos: tuple[int, ...], progress: bool):
        import openvino_genai as ov_genai

        s = settings(name, options)
        props = {"INFERENCE_NUM_THREADS": threads}
        if s["precision"] != "auto":
            props["INFERENCE_PRECISION_HINT"] = s["precision"]
        model = openvino_model(target_folder, s["weights"], progress)
        if name == "openvino-draft":
            if draft_folder is None:
                raise UsageError("openvino-draft needs --draft")
            draft = openvino_model(draft_folder, s["draft_weights"], progress)
            self.pipe = ov_genai.LLMPipeline(str(model), "CPU", draft_model=ov_genai.draft_model(str(draft), "CPU", **props), **props)
        elif name == "openvino-pld":
            self.pipe = ov_genai.LLMPipeline(str(model), "CPU", prompt_lookup=True, **props)
        else:
            self.pipe = ov_genai.LLMPipeline(str(model), "CPU", **props)
        self.name, self.s, self.eos = name, s, tuple(eos)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> list[int]:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        config = self.pipe.get_generation_config()
        config.max_new_tokens = max_new_tokens
        config.stop_token_ids = set(self.eos)
        config.ignore_eos = False
        if temperature > 0:
            config.do_sample, config.temperature, config.top_k, config.top_p, config.rng_seed = True, temperature, 0, 1.0, seed
        else:
            config.do_sample = False
        if self.name != "openvino":
            config.num_assistant_tokens = self.s["k"]
        if self.name == "openvino-pld":
            config.max_ngram_size = self.s["ngram_max"]
        ids = np.array([prompt_ids], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        tokens = list(self.pipe.generate(inputs, config).tokens[0])
        while tokens and tokens[-1] in self.eos:  # its stop token is part of its output; speclm's is not
            tokens.pop()
        return tokens[:max_new_tokens]


def make_peer(name: str, options: dict, target: str, draft: str | None, n_ctx: int, threads: int,
              eos: tuple[int, ...], progress: bool = True):
    """The peer engine for method `name` over catalog name / folder / file `target` (and `draft`)."""
    from speclm.models.loading import resolve_model

    folder = Path(resolve_model(target, progress=progress))
    if name in LLAMA_CPP:
        gguf = folder / "model.gguf" if folder.is_dir() else folder
        if not gguf.is_file():
            raise UsageError(f"method {name} runs llama.cpp on a GGUF file; {target} has none "
                             "(name a catalog model or a .gguf file)")
        return LlamaCppPeer(gguf, name, options, n_ctx, threads, eos)
    draft_folder = Path(resolve_model(draft, progress=progress)) if draft and name == "openvino-draft" else None
    return OpenVINOPeer(folder, draft_folder, name, options, threads, eos, progress)


def optimum_cli() -> str:
    path = os.environ.get("SPECLM_OPTIMUM_CLI") or shutil.which("optimum-cli")
    if not path or not Path(path).is_file():
        raise UsageError("openvino methods need the model exported by optimum-intel and no optimum-cli was found: "
                         "make peers builds one in .venv-openvino-export (optimum-intel pins an older transformers "
                         "than speclm's); set SPECLM_OPTIMUM_CLI to it")
    return path


def openvino_model(folder: Path, weights: str, progress: bool = True) -> Path:
    """The OpenVINO export of model `folder` with `weights`, made once into speclm's cache.

    speclm's folder may hold a GGUF file, which optimum-intel does not read: the weights are
    de-quantized by transformers (as speclm loads them) into a temporary safetensors folder,
    and optimum-cli exports that, with the tokenizer for OpenVINO GenAI."""
    from speclm.models import store

    final = store.model_home() / "openvino" / f"{folder.name}-{weights}"
    if store.is_model_folder(final):
        return final
    cli = optimum_cli()

    def build(work: Path) -> Path:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = work / "hf"
        gguf = {"gguf_file": "model.gguf"} if (folder / "model.gguf").is_file() else {}
        print(f"speclm: exporting {folder.name} to OpenVINO ({weights} weights) with optimum-intel, once...",
              file=sys.stderr, flush=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf)
        # GGUF blocks are de-quantized to plain fp32 tensors at load; transformers still marks the
        # model as quantized by GGUF and refuses to save it, so the marks go
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(source)
        del model
        AutoTokenizer.from_pretrained(folder, **gguf).save_pretrained(source)
        for extra in ("chat_template.jinja", "generation_config.json"):
            if (folder / extra).is_file():
                shutil.copy(folder / extra, source / extra)
        out = work / "model"
        done = subprocess.run([cli, "export", "openvino", "--model", str(source), "--task", "text-generation-with-past",
                               "--weight-format", weights, str(out)],
                              stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise UsageError(f"optimum-cli could not export {folder.name}: {last}")
        shutil.rmtree(source)
        return out

    return store.publish_model_folder(final, f"openvino-{folder.name}-{weights}", build,
                                      {"name": folder.name, "source": str(folder), "openvino_weights": weights})
