"""The GEMM shapes the kernel benchmarks share, (out, in) per weight (imported as `gemm_shapes`, as
timing.py is)."""

# One decode step of Qwen2.5-1.5B (the default target): per layer q|k|v, o, gate|up, down; then the
# output head. 1.54 G weights.
TARGET_STEP = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)]
# Qwen2.5-0.5B (the default draft): its layers and its output head.
DRAFT_LAYERS = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 24
DRAFT_HEAD = [(151936, 896)]
# A tiny model's step, for the scripts' --smoke runs.
SMOKE_LAYERS = [(128, 64), (64, 64), (256, 64), (64, 128)] * 2
SMOKE_HEAD = [(320, 64)]
SMOKE_STEP = SMOKE_LAYERS + SMOKE_HEAD
