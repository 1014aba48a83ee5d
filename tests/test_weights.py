"""Loading: a model built tensor by tensor from its GGUF or safetensors (speclm.models.weights)
holds the very values transformers' `from_pretrained` gives; quantized models are cached on disk
(speclm.models.qcache) and load from there to the same bits; nothing stays mapped after a load."""

from pathlib import Path

import pytest
import torch

from test_store import write_tiny_gguf
from tiny import byte_tokenizer, require_compiled_kernels, tiny_model

from speclm.forward.embedding import PackedEmbedding
from speclm.models import qcache, store, weights
from speclm.models.loading import load_model
from speclm.quant.weights import quantize_model

IDS = torch.tensor([[3, 100, 7, 256, 42, 42, 9]])


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _reference(folder: Path, **kw):
    """transformers' model of a folder or of its GGUF (`gguf_file`), with the config the store
    completes from a Gemma file (speclm.models.store.complete_config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from speclm.models.store import complete_config

    if "gguf_file" in kw:
        kw["config"] = AutoConfig.from_pretrained(folder, gguf_file=kw["gguf_file"])
        complete_config(kw["config"], folder / kw["gguf_file"])
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def _gguf(tmp_path: Path, **kw) -> tuple[Path, object]:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True, **kw)
    return path, _reference(tmp_path, gguf_file="tiny.gguf")


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_store_folder_holds_the_file_and_loads_the_same_values(home, tmp_path, tied):
    path, ref = _gguf(tmp_path, tied=tied)
    got = load_model(str(path), progress=False).model
    folder = next((home / "models").glob("gguf-tiny-*"))
    assert (folder / weights.GGUF_FILE).read_bytes() == path.read_bytes()
    assert not list(folder.glob("*.safetensors"))  # no de-quantized copy
    ours, theirs = dict(got.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied
    assert torch.equal(got(IDS).logits, ref(IDS).logits)
    # the store's index of the file (no metadata parsing at load) and gguf's own reader: the same model
    index = folder / (weights.GGUF_FILE + weights.INDEX_SUFFIX)
    assert weights.read_index(folder / weights.GGUF_FILE) is not None
    index.unlink()
    again = dict(load_model(str(path), progress=False).model.named_parameters())
    assert all(torch.equal(again[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_loads_equal_quantizing_transformers_model_and_keep_the_table_as_blocks(home, tmp_path, mode, tied):
    require_compiled_kernels()
    path, ref = _gguf(tmp_path, tied=tied)
    table = ref.model.embed_tokens.weight.detach().clone()
    quantize_model(ref, mode)
    want = ref(IDS).logits
    first = load_model(str(path), quantize=mode, progress=False).model
    embed = first.model.embed_tokens
    assert isinstance(embed, PackedEmbedding) and embed.kind == "Q5_0"
    assert torch.equal(embed.full(), table)  # row by row de-quantization: the whole table's bits
    assert torch.equal(first(IDS).logits, want)
    assert len(list((home / "quantized").glob(f"*-{mode}-*.safetensors"))) == 1
    second = load_model(str(path), quantize=mode, progress=False).model  # from the cache
    assert torch.equal(second(IDS).logits, want)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_table_kept_as_blocks_keeps_its_embed_scale(home, tmp_path, arch):
    """Gemma's embedding module returns its rows times sqrt(hidden) (embed_scale); the compact
    table put in its place keeps that scale (tied head: the unscaled table), so the int8 model,
    built and read back from the quantized-weights cache, is transformers' model quantized."""
    require_compiled_kernels()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True, tied=True, arch=arch)
    ref = _reference(tmp_path, gguf_file="tiny.gguf")
    rows = ref.model.embed_tokens(IDS).detach()  # scaled
    table = ref.model.embed_tokens.weight.detach().clone()
    assert not torch.equal(rows, table[IDS])
    quantize_model(ref, "int8")
    want = ref(IDS).logits
    for _ in ("built", "cached"):
        model = load_model(str(path), quantize="int8", progress=False).model
        embed = model.model.embed_tokens
        assert isinstance(embed, PackedEmbedding) and embed.kind == "Q5_0"
        assert torch.equal(embed(IDS), rows) and torch.equal(embed(IDS), rows)  # the second through the row cache
        assert torch.equal(embed.full(), table)
        assert torch.equal(model(IDS).logits, want)
    assert len(list((home / "quantized").glob("*-int8-*.safetensors"))) == 1


def test_small_lookups_through_the_row_cache_give_the_tables_rows(home, tmp_path, monkeypatch):
    from speclm.forward import embedding

    require_compiled_kernels()
    path, ref = _gguf(tmp_path)
    table = ref.model.embed_tokens.weight.detach()
    embed = load_model(str(path), quantize="int8", progress=False).model.model.embed_tokens
    assert isinstance(embed, PackedEmbedding) and embed.kind != "dense"
    monkeypatch.setattr(embedding, "ROW_CACHE", 3)  # evictions on the way
    reads = []
    lookup = embed._lookup
    monkeypatch.setattr(embed, "_lookup", lambda flat: reads.append(len(flat)) or lookup(flat))
    for ids in ([[5, 9], [9, 5]], [[9]], [[1, 2, 3, 1]], [[9, 1]], [[4, 5, 6, 7]], [[]]):
        ids = torch.tensor(ids, dtype=torch.long).view(len(ids), -1)
        assert torch.equal(embed(ids), table[ids]), ids
    # 5, 9; then 9 cached; 1, 2, 3; 9 had left (3 rows kept), 1 cached; four rows, more than are kept
    assert reads == [2, 3, 1, 4]
    assert len(embed._rows) == 3
    big = torch.arange(embedding.SMALL + 1)
    assert torch.equal(embed(big), table[big]) and reads[-1] == len(big)  # a prefill reads the table


def test_a_cached_load_reads_no_checkpoint_and_a_new_checkpoint_gets_a_new_file(home, tmp_path, monkeypatch):
    require_compiled_kernels()
    tok = byte_tokenizer()
    model = tiny_model(len(tok), seed=0)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    want = quantize_model(tiny_model(len(tok), seed=0), "int8")(IDS).logits
    assert torch.equal(load_model(str(folder), quantize="int8", progress=False).model(IDS).logits, want)
    files = list((home / "quantized").iterdir())
    assert len(files) == 1

    def no_checkpoint(*a, **k):
        raise AssertionError("read the checkpoint")

    with monkeypatch.context() as m:
        m.setattr(weights, "open_weights", no_checkpoint)
        assert torch.equal(load_model(str(folder), quantize="int8", progress=False).model(IDS).logits, want)
    tiny_model(len(tok), seed=5).save_pretrained(folder)  # replaced in place
    other = quantize_model(tiny_model(len(tok), seed=5), "int8")(IDS).logits
    assert torch.equal(load_model(str(folder), quantize="int8", progress=False).model(IDS).logits, other)
    assert [p.name for p in (home / "quantized").iterdir()] != [f.name for f in files]  # the old file replaced
    assert len(list((home / "quantized").iterdir())) == 1


def test_a_damaged_cache_file_is_made_anew_and_one_of_another_layout_is_ignored(home, tmp_path, capsys, monkeypatch):
    require_compiled_kernels()
    path, ref = _gguf(tmp_path)
    want = quantize_model(ref, "int8")(IDS).logits
    load_model(str(path), quantize="int8", progress=False)
    cached = next((home / "quantized").iterdir())
    cached.write_bytes(cached.read_bytes()[:1000])
    assert torch.equal(load_model(str(path), quantize="int8", progress=False).model(IDS).logits, want)
    assert "ignoring the quantized-weights cache" in capsys.readouterr().err
    monkeypatch.setattr(qcache, "LAYOUT_VERSION", qcache.LAYOUT_VERSION + 1)
    assert qcache.load(weights.skeleton(ref.config, torch.float32), cached, "int8") is None  # not misread
    assert torch.equal(load_model(str(path), quantize="int8", progress=False).model(IDS).logits, want)
    assert [p.name for p in (home / "quantized").iterdir()] != [cached.name]  # keyed by the layout version too


def test_bf16_checkpoint_keeps_its_table_in_bf16(home, tmp_path):
    require_compiled_kernels()
    tok = byte_tokenizer()
    model = tiny_model(len(tok), seed=0).to(torch.bfloat16)
    folder = tmp_path / "bf16"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    ref = quantize_model(_reference(folder), "int8")
    got = load_model(str(folder), quantize="int8", progress=False).model
    assert got.model.embed_tokens.kind == "dense" and got.model.embed_tokens.data.dtype == torch.bfloat16
    assert torch.equal(got(IDS).logits, ref(IDS).logits)


def test_the_first_quantization_holds_one_layer_in_fp32_at_a_time(home, tmp_path, monkeypatch):
    require_compiled_kernels()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True, layers=3)
    seen = []
    real = weights.build

    def build(model, source, dtype, quantize, quantize_tree, progress=True):
        def tree(module):
            fp32 = [n for n, p in model.named_parameters() if not p.is_meta and p.dim() == 2]
            seen.append(len(fp32))
            quantize_tree(module)
        return real(model, source, dtype, quantize, tree, progress)

    monkeypatch.setattr(weights, "build", build)
    load_model(str(path), quantize="int8", progress=False)
    # each layer's 7 matrices, then the output head with the table (read for the head, kept as blocks)
    assert seen == [7, 7, 7, 1]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc")
def test_no_weights_file_stays_mapped_after_a_load(home, tmp_path):
    require_compiled_kernels()
    path, _ = _gguf(tmp_path)
    tok = byte_tokenizer()
    folder = tmp_path / "st"
    tiny_model(len(tok), seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    kept = [load_model(str(path), quantize=q, progress=False) for q in ("none", "int8", "int8")]
    kept += [load_model(str(folder), quantize=q, progress=False) for q in ("none", "int4", "int4")]
    maps = Path("/proc/self/maps").read_text()
    assert ".gguf" not in maps and ".safetensors" not in maps
    assert len(kept) == 6


def test_a_hub_id_loads_from_the_snapshot_huggingface_hub_gives(home, tmp_path, monkeypatch):
    import huggingface_hub

    tok = byte_tokenizer()
    folder = tmp_path / "snapshot"
    tiny_model(len(tok), seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or str(folder))
    got = load_model("someone/tiny", progress=False)
    assert asked == ["someone/tiny"] and got.model.config.hidden_size == 64


def test_models_rm_removes_the_quantized_files_with_the_model(home, tmp_path):
    require_compiled_kernels()
    path, _ = _gguf(tmp_path)
    load_model(str(path), quantize="int8", progress=False)
    folder = next((home / "models").glob("gguf-tiny-*"))
    assert qcache.files_for(folder)
    store.remove(folder.name)
    assert not qcache.files_for(folder) and not folder.exists()


def test_models_rm_and_list_on_the_command_line(home, tmp_path, capsys):
    from speclm.cli import main

    path, _ = _gguf(tmp_path)
    load_model(str(path), quantize="int8", progress=False)
    name = next((home / "models").glob("gguf-tiny-*")).name
    assert main(["models", "list"]) == 0
    assert f"{name} " in capsys.readouterr().out
    assert main(["models", "rm", name]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["models", "rm", name]) == 2  # no longer cached: one line
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not in the cache" in err


def test_transformers_generate_runs_on_a_compact_table(home, tmp_path):
    """bench's hf peers call transformers' `generate` on the loaded model: with the embedding
    table kept as GGUF blocks it runs, plainly and assisted, and its greedy tokens start as
    speclm's (transformers' batched attention may round differently later)."""
    require_compiled_kernels()
    from speclm import SpecEngine
    from speclm.bench.methods import parse_methods, run_method

    path, _ = _gguf(tmp_path)
    model = load_model(str(path), quantize="int8", progress=False)
    assert isinstance(model.model.get_input_embeddings(), PackedEmbedding)
    engine = SpecEngine(model, draft=model)
    ids = [5, 6, 7, 8, 9]
    ours = run_method(parse_methods("none")[0], engine, ids, 6, 0.0, 0).token_ids
    for spec in parse_methods("hf,hf-assisted:k=2"):
        theirs = run_method(spec, engine, ids, 6, 0.0, 0).token_ids
        assert len(theirs) == 6 and theirs[0] == ours[0], spec.label
