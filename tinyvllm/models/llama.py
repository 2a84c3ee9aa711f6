"""The Llama family: Llama, Qwen2, Qwen3 and Mistral through config switches.

Parameter names follow HF checkpoints except that q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`); `load_weights` maps the split checkpoint tensors in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tinyvllm.attention.layer import Attention
from tinyvllm.models.layers.activation import SiluAndMul
from tinyvllm.models.layers.embedding import VocabEmbedding, output_head
from tinyvllm.models.layers.gated_mlp import gated_mlp
from tinyvllm.models.layers.linear import MergedColumnLinear, QKVLinear, ReplicatedLinear
from tinyvllm.models.layers.norm import RMSNorm
from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
from tinyvllm.models.weights import load_named_weights
from tinyvllm.native.decode_plan import DecodeLayerPlan, DecodePlan, NativeMatrix
from tinyvllm.native.ops import elementwise_rows_fit
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import finalize_quantized_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tinyvllm.attention.backend import AttentionMetadata
    from tinyvllm.gguf.weight import GGUFWeight


@dataclass(frozen=True)
class FamilyOptions:
    """What distinguishes the members of the family beyond their HF config values."""

    # None: read `config.attention_bias`.
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    qk_norm: bool = False
    # "layer_types": slide only layers marked "sliding_attention" (Qwen2/Qwen3);
    # "all": every layer slides when `config.sliding_window` is set (Mistral).
    sliding_window_mode: str = "layer_types"


def layer_sliding_windows(config: Any, mode: str) -> list[int | None]:
    """Per-layer sliding window (None = full attention)."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    if mode == "all":
        return [window] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        # Pre-v5 Qwen configs: layers from max_window_layers upwards slide.
        first = getattr(config, "max_window_layers", 0)
        return [window if i >= first else None for i in range(num_layers)]
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


def _native_matrix(layer: nn.Module, bias: torch.Tensor | None) -> NativeMatrix | None:
    """A linear layer's or embedding's weight as the native kernels read it (None: they
    cannot, e.g. int8 / int4 repacked)."""
    qweight = layer.qweight
    if qweight is None:
        return NativeMatrix.dense(layer.weight, bias)
    native = qweight.native_weight
    return None if native is None else NativeMatrix(native[1], native[0], bias)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        options: FamilyOptions,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        quant_config: QuantConfig | None = None,
        *,
        scale: float | None = None,
        norm_class: type[RMSNorm] = RMSNorm,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if options.qkv_bias is None else options.qkv_bias
        o_bias = attention_bias if options.o_proj_bias is None else options.o_proj_bias
        self.head_dim = head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, quant_config
        )
        self.o_proj = ReplicatedLinear(
            num_heads * head_dim, config.hidden_size, o_bias, quant_config
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = norm_class(head_dim, eps=config.rms_norm_eps)
            self.k_norm = norm_class(head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            layer_idx,
            num_heads,
            num_kv_heads,
            head_dim,
            scale=head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # Qwen3 normalises each head separately, before rope.
        native = norm.native
        if native is not None and elementwise_rows_fit(x) and x.dtype == norm.weight.dtype:
            native.head_norm_(x, self.head_dim, norm.weight, norm.eps)  # x: fresh qkv rows
            return x
        return norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._head_norm(self.q_norm, q)
            k = self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; use 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size], bias, quant_config)
        self.act = SiluAndMul()
        self.down_proj = ReplicatedLinear(size, config.hidden_size, bias, quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.gate_up_proj, self.act, self.down_proj, x)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        options: FamilyOptions,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, layer_idx, options, rotary_emb, sliding_window, quant_config
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config, quant_config)

    def input_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed input, residual stream): the previous layer's residual add is fused into
        this norm; the first layer has none yet."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def native_plan(self) -> DecodeLayerPlan | None:
        """This layer for the native decode program (None: it cannot run it); call after
        the KV cache is bound."""
        attn, mlp = self.self_attn, self.mlp
        kv_cache = attn.attn.kv_cache
        if kv_cache is None or attn.attn.logits_soft_cap:
            return None
        qkv = _native_matrix(attn.qkv_proj, attn.qkv_proj.bias)
        o = _native_matrix(attn.o_proj, attn.o_proj.bias)
        gate_up = _native_matrix(mlp.gate_up_proj, mlp.gate_up_proj.bias)
        down = _native_matrix(mlp.down_proj, mlp.down_proj.bias)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return DecodeLayerPlan(
            input_norm=self.input_layernorm.weight,
            post_attention_norm=self.post_attention_layernorm.weight,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            kv_cache=kv_cache,
            sliding_window=attn.attn.sliding_window or 0,
        )


class LlamaModel(nn.Module):
    # Multiplies the embedding rows (Gemma: sqrt(hidden_size)); 1.0 is no scaling.
    embed_scale: float = 1.0

    def __init__(
        self,
        config: Any,
        max_model_len: int,
        options: FamilyOptions,
        quant_config: QuantConfig | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config)
        # One table shared by all layers; sized for the longest sequence we serve. A model
        # with another position scheme (M-RoPE) brings its own.
        self.rotary_emb = rotary_emb or RotaryEmbedding(
            RopeConfig.from_hf_config(config), max_model_len
        )
        windows = layer_sliding_windows(config, options.sliding_window_mode)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, options, self.rotary_emb, windows[i], quant_config)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM: `forward` returns final hidden states; `compute_logits` projects
    the rows the sampler needs. `quant_config` builds weight-only quantized linear layers,
    embedding and lm_head (None: float weights in the default dtype)."""

    options: ClassVar[FamilyOptions] = FamilyOptions()
    # The decoder stack (a subclass with other layers keeps this class's head and loading).
    model_class: ClassVar[type[nn.Module]] = LlamaModel

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(
        self,
        config: PretrainedConfig,
        max_model_len: int,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.max_model_len = max_model_len
        self.quant_config = quant_config
        self.model = self.build_language_model(config, max_model_len, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # False once a checkpoint without its (untied) lm_head is loaded: pooling only.
        self.has_lm_head = True
        self.lm_head = output_head(self.model.embed_tokens, self.tie_word_embeddings, quant_config)

    def build_language_model(
        self, config: Any, max_model_len: int, quant_config: QuantConfig | None
    ) -> nn.Module:
        """The decoder stack: `model_class` (a subclass with another position scheme or other
        layers builds its own, reusing this class's head and loading); it must expose
        `embed_tokens`."""
        return self.model_class(config, max_model_len, self.options, quant_config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def native_decode_plan(self) -> DecodePlan | None:
        """Every tensor the native decode program reads, per layer (None: this model cannot
        run as one native call); call after the KV caches are bound."""
        inner = self.model
        layers = [layer.native_plan() for layer in inner.layers]
        embed = _native_matrix(inner.embed_tokens, None)
        eps = {layer.input_layernorm.eps for layer in inner.layers}
        if embed is None or len(eps) != 1 or any(layer is None for layer in layers):
            return None
        first = inner.layers[0]
        attn, rope = first.self_attn.attn, inner.rotary_emb
        return DecodePlan(
            dtype=inner.norm.weight.dtype,
            embed=embed,
            final_norm=inner.norm.weight,
            cos_cache=rope.cos_cache,
            sin_cache=rope.sin_cache,
            layers=tuple(layer for layer in layers if layer is not None),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            rotary_dim=rope.rotary_dim,
            intermediate_size=first.mlp.down_proj.input_size,
            eps=eps.pop(),
            scale=attn.scale,
            embed_scale=inner.embed_scale,
            activation=first.mlp.act.name,
        )

    def _ignored_checkpoint_tensor(self, name: str) -> bool:
        if "rotary_emb." in name:  # inv_freq / cos / sin caches some exports include
            return True
        # Tied checkpoints sometimes still store the (identical) output projection.
        return self.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]]) -> None:
        """Copy checkpoint tensors, streamed one by one, into the parameters (quantized
        layers also take raw GGUF blocks). A headless backbone (the base model saved alone,
        as Qwen3-Embedding ships: no "model." prefix, no lm_head) loads too; it can pool but
        not generate (`has_lm_head` False when its untied lm_head is missing)."""
        names = _BackboneNames()
        skipped = load_named_weights(
            self,
            names.prefixed(weights),  # type: ignore[arg-type]
            stacked_params=self.stacked_params,
            ignore=self._ignored_checkpoint_tensor,
            optional=lambda name: names.headless and name == "lm_head.weight",
        )
        self.has_lm_head = "lm_head.weight" not in skipped
        self._check_norms_finite()
        finalize_quantized_weights(self)

    def _check_norms_finite(self) -> None:
        # A NaN/inf norm weight makes every logit NaN (greedy then emits token 0 forever);
        # the norms are small, so checking them all costs nothing.
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm) and not torch.isfinite(module.weight).all():
                raise ValueError(
                    f"checkpoint tensor {name}.weight holds NaN or infinite values "
                    "(a corrupt file?)"
                )


class _BackboneNames:
    """Maps a headless backbone's tensor names ("layers.0...", "embed_tokens.weight") onto
    the model's ("model.layers.0..."), noting whether the checkpoint was one."""

    def __init__(self) -> None:
        self.headless = False

    def prefixed(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if not name.startswith(("model.", "lm_head.")):
                self.headless = True
                name = f"model.{name}"
            yield name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    options: ClassVar[FamilyOptions] = FamilyOptions(sliding_window_mode="all")


class Qwen2ForCausalLM(LlamaForCausalLM):
    options: ClassVar[FamilyOptions] = FamilyOptions(qkv_bias=True, o_proj_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    options: ClassVar[FamilyOptions] = FamilyOptions(qk_norm=True)
