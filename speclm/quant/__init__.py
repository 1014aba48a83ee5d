"""Quantized weights whose results do not depend on the batch: int8/int4 linear layers (weights)
and the compiled CPU kernels they run on (kernels, built from csrc/ once per machine)."""
