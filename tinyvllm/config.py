"""Engine configuration: EngineArgs (the user's knobs, vLLM names) -> EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tinyvllm.quant.config import QuantConfig, parse_quantization

# Supported values of mamba_cache_mode (vLLM also has "all": snapshots at every block).
MAMBA_CACHE_MODES = ("align", "none")
# Supported values of mamba_ssm_cache_dtype ("auto": float32, see CacheConfig).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNNERS = ("auto", "generate", "pooling")
# max_num_seqs when the user leaves it unset (a hybrid model may run fewer: see kv_cache.py).
DEFAULT_MAX_NUM_SEQS = 256
POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector (vLLM's names).

    None fields take the checkpoint's sentence-transformers config (1_Pooling/config.json and
    a Normalize module in modules.json), else the model kind's default: CLS for encoders,
    LAST for decoders, normalized.
    """

    pooling_type: str | None = None  # "MEAN" | "CLS" | "LAST"
    normalize: bool | None = None

    @classmethod
    def from_value(cls, value: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        if value is None:
            return cls()
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"pooling_type", "normalize"})
            if unknown:
                raise ValueError(
                    f"pooler_config has unknown key(s) {unknown}; it takes pooling_type and "
                    "normalize"
                )
            value = cls(**value)
        if not isinstance(value, cls):
            raise TypeError(f"pooler_config must be a PoolerConfig or a dict, got {value!r}")
        if value.pooling_type is not None:
            kind = str(value.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config pooling_type={value.pooling_type!r} is not supported; "
                    f"choose one of {', '.join(POOLING_TYPES)}"
                )
            value = PoolerConfig(kind, value.normalize)
        return value


@dataclass
class ModelConfig:
    model: str
    model_path: str  # resolved local directory
    tokenizer: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    vocab_size: int
    seed: int
    hf_config: Any = field(repr=False, default=None)
    # False when max_model_len came from the model config (then it may shrink to fit the KV).
    max_model_len_explicit: bool = True
    # Weight-only quantization of this checkpoint (None: as stored), resolved once from
    # `requested_quantization` by the engine's setup.
    quantization: QuantConfig | None = None
    # The user's `quantization=` (validated): a draft model resolves it against its own
    # checkpoint, as the target's was.
    requested_quantization: str | None = None
    # EVS: the share of video tokens dropped after the vision encoder (0 = off).
    video_pruning_rate: float = 0.0
    # "generate" (the LLM path) or "pooling" (embeddings: no KV cache, no sampling), and for
    # pooling how prompts are pooled (resolved: every field set).
    runner_type: str = "generate"
    pooler_config: PoolerConfig | None = None


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Hybrid models' recurrent state in the prefix cache (vLLM's name): "align" snapshots the
    # state where prefill chunks end on block boundaries; "none" caches no state (and so no
    # prefix of a hybrid model). Models without recurrent layers ignore it.
    mamba_cache_mode: str = "align"
    # Dtype of Mamba2 mixers' SSM state (vLLM's name). "auto" is float32 whatever the model
    # dtype (the recurrence accumulates over the whole sequence; vLLM's "auto" follows the
    # model dtype); "bfloat16" / "float16" halve the state per request (Granite 4.0-H 350M:
    # ~22 MiB -> ~11 MiB) at some accuracy. The conv windows stay in the model dtype.
    mamba_ssm_cache_dtype: str = "auto"

    @property
    def caches_state_snapshots(self) -> bool:
        return self.enable_prefix_caching and self.mamba_cache_mode == "align"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # False: the user left max_num_seqs unset, so the engine may lower it to the recurrent-state
    # slots a hybrid model's cache budget holds.
    max_num_seqs_explicit: bool = True
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    # Extra slots each request's blocks must cover beyond its scheduled tokens (draft models).
    num_lookahead_tokens: int = 0
    # Media spans attended bidirectionally (Gemma 3 images): a chunk never splits one, and a
    # prefix-cache hit never ends inside one.
    atomic_mm_spans: bool = False


@dataclass
class DeviceConfig:
    device: str = "cpu"
    attention_backend: str | None = None
    # The plain PyTorch path: no CUDA graphs on GPU, no native library at all on CPU (see
    # tinyvllm/platforms/).
    enforce_eager: bool = False
    # Bytes the CPU platform may spend on GEMM copies of bf16 weights (None: no limit): fp32
    # copies without bf16 matmul, oneDNN-prepacked bf16 copies with it (AMX), and the native
    # decode program's pair-layout bf16 copies on AVX-512 CPUs without BF16 (1x).
    fp32_weight_copy_bytes: int | None = None


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    # A validated tinyvllm.spec_decode.SpeculativeConfig, or None (no speculation).
    speculative: Any = None


@dataclass
class EngineArgs:
    """Everything `LLM(...)` accepts; names and defaults follow vLLM."""

    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    revision: str | None = None
    download_dir: str | None = None
    # A .gguf file inside `model` (a directory or hub repo); `model` may also be the file.
    gguf_file: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    # Weight-only quantization: "auto" keeps a GGUF file's quantized blocks ("gguf") and
    # loads other checkpoints as they are; None (or "none") dequantizes everything to
    # `dtype`; "int8" / "int4" quantize float weights at load.
    quantization: str | None = "auto"
    # Opt-in, changes rounding: decode GEMVs over a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks
    # round their activations to int8 per block of 32 and multiply in integers (llama.cpp's
    # arithmetic; AVX512-VNNI or AVX2 kernels on matrices of whole 16-row groups, else the
    # exact kernels run). Needs quantized GGUF weights kept as blocks (quantization "auto" or
    # "gguf") on the CPU.
    int8_activations: bool = False
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    # None: DEFAULT_MAX_NUM_SEQS, or fewer for a hybrid model whose recurrent state for that
    # many requests would not fit its share of the KV cache budget.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # "align" | "none": see CacheConfig.mamba_cache_mode.
    mamba_cache_mode: str = "align"
    # "auto" | "float32" | "bfloat16" | "float16": see CacheConfig.mamba_ssm_cache_dtype.
    mamba_ssm_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str | None = None
    enforce_eager: bool = False
    # CPUs without bf16 matmul (AVX2) run batched bf16 GEMMs on fp32 copies of the weights
    # (2x the bf16 bytes), made at a layer's first batched GEMM; CPUs with it (AMX) run batched
    # decode GEMMs on copies prepacked in oneDNN's layout (1x, same results): at most this many
    # bytes of them (None: no limit; 0: none, those GEMMs then run slower, no extra memory).
    # The same budget covers the native decode program's bf16 copies in its pair layout (1x,
    # AVX-512 CPUs without BF16: batched decode GEMMs 1.2-1.9x faster), made at the program's
    # first step of 8+ requests, after what the fp32 copies may still need.
    fp32_weight_copy_bytes: int | None = None
    # vLLM's speculative_config dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: dict[str, Any] | None = None
    # EVS (Efficient Video Sampling) for video VLMs: drop this share of the video tokens that
    # change least from the previous frame, after the vision encoder; None or 0 = off.
    video_pruning_rate: float | None = None
    # "auto": pooling for encoder-only checkpoints (BertModel) and sentence-transformers
    # directories (modules.json), else generate.
    runner: str = "auto"
    # Overrides the checkpoint's pooling (pooling models only): PoolerConfig or a dict.
    pooler_config: PoolerConfig | dict[str, Any] | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {unknown}; supported: {sorted(known - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.fp32_weight_copy_bytes is not None and self.fp32_weight_copy_bytes < 0:
            raise ValueError(
                "fp32_weight_copy_bytes must be 0 (no fp32 weight copies) or more, got "
                f"{self.fp32_weight_copy_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        parse_quantization(self.quantization)
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got "
                f"{self.mamba_cache_mode!r} (vLLM's 'all' mode is not supported)"
            )
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}, got "
                f"{self.mamba_ssm_cache_dtype!r}"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        PoolerConfig.from_value(self.pooler_config)
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        rate = self.video_pruning_rate
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0
        ):
            raise ValueError(
                f"video_pruning_rate must be a number in [0, 1) (the share of video tokens "
                f"EVS drops; 0 = off), got {rate!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
