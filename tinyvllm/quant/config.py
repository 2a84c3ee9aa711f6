"""Which weight-only quantization a model is built with: vLLM's `quantization=` argument,
parsed once here into a `QuantConfig` (torch-free: the engine's config imports it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

QUANT_METHODS = ("int8", "int4", "gguf")
# Every `quantization=` value: "auto" resolves against the checkpoint (see
# `resolve_quantization`), "none" (or None) loads it as stored.
QUANTIZATION_OPTIONS = ("auto", "none", *QUANT_METHODS)
# Group sizes torch's CPU int4 kernel accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of a model's linear layers, embedding and lm_head.

    - "int8": float checkpoint weights become int8 with one symmetric scale per output row.
    - "int4": float weights become 4-bit values with a scale and zero point per
      `group_size` input columns (layers whose input size is not a multiple of
      `group_size` fall back to int8).
    - "gguf": weights arrive as raw GGUF blocks. On CPUs where the native kernels load,
      Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices are kept as the file's blocks (a fused layer's
      shards must share one type) and computed on directly; otherwise Q4_0/Q4_1/Q4_K repack
      losslessly into int4 groups of 32, and every other format (and float tensors) becomes
      int8 per row.

    The embedding table and lm_head are int8 per row for "int8"/"int4": one copy then serves
    both the row lookup and the output projection of tied models. For "gguf" they keep the
    file's exact values (`exact`): the blocks themselves where the native kernels read them,
    else floats in the model dtype. Requantizing a block-scaled table (Q8_0, Q6_K) to one scale
    per row moves the logits by ~1%, enough to flip near-tied greedy choices of small models.
    Norms and biases stay float.
    """

    method: str
    group_size: int = 32
    # Never requantize: keep GGUF blocks the kernels read, else dequantize to the model dtype.
    exact: bool = False
    # Opt-in, not exact: decode GEMVs over Q4_0 / Q4_1 / Q8_0 blocks round their activations
    # to int8 per block of 32 (llama.cpp's arithmetic; x86 CPUs, on matrices of whole 16-row
    # groups; elsewhere the exact kernels run). See EngineArgs.int8_activations.
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(
                f"quantization method {self.method!r} is not supported; choose one of "
                f"{', '.join(QUANT_METHODS)}"
            )
        if self.int8_activations and self.method != "gguf":
            raise ValueError(
                f"int8_activations needs quantization='gguf' (GGUF block weights), got "
                f"{self.method!r}"
            )
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"group_size={self.group_size} is not supported; choose one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}"
            )

    def output_config(self) -> QuantConfig:
        """The config of the embedding table and lm_head (see above)."""
        if self.method == "gguf":
            return replace(self, exact=True)
        return replace(self, method="int8")

    def __str__(self) -> str:
        return self.method


def parse_quantization(value: str | None) -> str | None:
    """The one check of a `quantization=` value: None (for None and "none"), "auto" or a
    method of QUANT_METHODS; ValueError naming the value and the choices otherwise."""
    if value is None or value == "none":
        return None
    if value not in QUANTIZATION_OPTIONS:
        raise ValueError(
            f"quantization must be one of 'auto', None, 'int8', 'int4', 'gguf'; got {value!r}"
        )
    return value


def resolve_quantization(
    quantization: str | None, gguf_path: str | Path | None
) -> QuantConfig | None:
    """The config one checkpoint loads with under `quantization=` (the target model's and a
    draft model's alike; `gguf_path` None: not a GGUF checkpoint). "auto" keeps a GGUF file's
    quantized blocks and loads anything else as stored; "gguf" needs a GGUF file."""
    method = parse_quantization(quantization)
    if method == "auto":
        if gguf_path is None:
            return None
        # Only here is the file read; the reader (and torch) load on this first use.
        from tinyvllm.gguf.reader import read_gguf

        return QuantConfig("gguf") if read_gguf(gguf_path).has_quantized_tensors() else None
    if method == "gguf" and gguf_path is None:
        raise ValueError(
            "quantization='gguf' needs a GGUF checkpoint; for a safetensors model use "
            "quantization='int8' or 'int4'"
        )
    return None if method is None else QuantConfig(method)
