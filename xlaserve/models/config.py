"""Model configuration: one frozen dataclass, built from HF `config.json`, GGUF metadata or the
JSON file that `xlaserve convert` writes beside a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xlaserve.models.quantize import check_quantization

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                           "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The sparse mixture-of-experts families (models/moe.py): every decoder layer's MLP is a routed
# set of experts.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


ROPE_SCALINGS = ("llama3", "linear", "longrope")
LAYER_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (models/rope.py): `llama3` (Llama 3.1+: low frequencies divided
    by `factor`, a smooth band between), `linear` (every frequency divided by `factor`: Gemma 3's
    global layers) or `longrope` (Phi-3/4: per-dimension divisors, `long_factor` when the model
    runs beyond `original_max_position_embeddings`, else `short_factor`, and cos/sin scaled by
    `attention_factor`)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    kind: str = "llama3"
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling.kind must be one of {', '.join(ROPE_SCALINGS)}, got "
                             f"{self.kind!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RopeScaling.factor must be a positive number, got {self.factor!r}")
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("RopeScaling: longrope needs short_factor and long_factor")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-dimension divisors of the rotary frequencies, [head_dim // 2]: llama.cpp's
    # `rope_freqs.weight`, which is how a GGUF stores Llama 3.1/3.2 scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    architecture: str = "llama"
    dtype: str = "float32"
    sliding_window: int | None = None  # Mistral: attend to the last this many positions
    # None: every parameter in `dtype`; "int8": the layer matrices (and an untied lm_head)
    # weight-only int8 with a scale per 32 weights along K; "fp8": the same as float8_e4m3fn,
    # a GPU option (models/quantize.py).
    quantization: str | None = None
    # Mixture of experts (models/moe.py); num_experts = 0 is the dense SwiGLU MLP.
    num_experts: int = 0                     # experts per layer (HF num_local_experts)
    num_experts_per_tok: int = 0             # top-k experts each token is routed to
    moe_intermediate_size: int = 0           # each expert's SwiGLU hidden size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob: bool = False             # renormalise the top-k gates to sum to 1
    attention_bias: bool = False             # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False                    # RMSNorm of q and k before RoPE (Qwen3, OLMoE)
    # ... over what: "head" each head's D (Qwen3), "all" every head's features at once (OLMoE:
    # its norm weights are [H*D] and [K*D]; a layout must not split the heads, see rules.py)
    qk_norm_span: str = "head"
    # The families' differences from the Llama block (models/families.py reads them):
    embed_scale: float = 1.0          # x = embed[tokens] * this (Gemma sqrt(E), Granite)
    attention_scale: float | None = None   # q.k multiplier; None: head_dim ** -0.5
    attn_soft_cap: float | None = None     # Gemma 2: cap * tanh(logits / cap) on q.k
    final_soft_cap: float | None = None    # Gemma 2: the same on the output logits
    logits_divisor: float = 1.0       # Granite's logits_scaling: logits / this
    post_norms: bool = False          # Gemma 2/3: RMSNorm of attn / MLP outputs before the add
    mlp_activation: str = "silu"      # the gated MLP's activation: silu, or gelu_tanh (Gemma)
    # Per layer "full" or "sliding" (Gemma 2/3); None: every layer alike, windowed when
    # `sliding_window` is set.  Sliding layers attend to the last `sliding_window` positions.
    layer_kinds: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' RoPE base, unscaled
    rotary_dim: int | None = None     # partial rotary (Phi-4-mini): rotate this many of D
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got "
                             f"{self.sliding_window!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_quantization(self.quantization, "ModelConfig.quantization")
        self._check_moe()
        self._check_family()
        if self.qk_norm_span not in ("head", "all"):
            raise ValueError(f"ModelConfig.qk_norm_span must be 'head' or 'all', got "
                             f"{self.qk_norm_span!r}")
        if self.rope_freq_factors is not None:
            factors = self.rope_freq_factors
            if len(factors) != self.head_dim // 2:
                raise ValueError(f"ModelConfig.rope_freq_factors has {len(factors)} values, "
                                 f"expected head_dim // 2 = {self.head_dim // 2}")
            bad = [f for f in factors if not (isinstance(f, float) and math.isfinite(f) and f > 0)]
            if bad:
                raise ValueError(f"ModelConfig.rope_freq_factors must be positive finite floats, "
                                 f"got {bad[:4]!r}")
            if self.rope_scaling is not None:
                raise ValueError("ModelConfig: rope_scaling and rope_freq_factors are both set; "
                                 "they are two forms of the same scaling, keep one")

    def _check_family(self) -> None:
        for name in ("embed_scale", "logits_divisor", "attention_scale", "attn_soft_cap",
                     "final_soft_cap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and
                                          not isinstance(value, bool) and
                                          math.isfinite(value) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.mlp_activation must be 'silu' or 'gelu_tanh', got "
                             f"{self.mlp_activation!r}")
        kinds = self.layer_kinds
        if kinds is not None:
            if len(kinds) != self.num_layers or set(kinds) - set(LAYER_KINDS):
                raise ValueError(f"ModelConfig.layer_kinds must give one of {LAYER_KINDS} for "
                                 f"each of the {self.num_layers} layers, got {kinds!r}")
            if "sliding" in kinds and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_kinds has sliding layers but "
                                 "sliding_window is None")
        if self.rope_local_theta is not None and kinds is None:
            raise ValueError("ModelConfig.rope_local_theta is set without layer_kinds")
        rd = self.rotary_dim
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd < 2
                               or rd % 2 or rd > self.head_dim):
            raise ValueError(f"ModelConfig.rotary_dim must be an even int in [2, head_dim="
                             f"{self.head_dim}], got {rd!r}")
        rs = self.rope_scaling
        if rs is not None and rs.kind == "longrope":
            want = (rd or self.head_dim) // 2
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != want:
                    raise ValueError(f"RopeScaling.{name} has {len(getattr(rs, name))} values, "
                                     f"expected rotary_dim // 2 = {want}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        if self.layer_kinds is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if k == "sliding" else None for k in self.layer_kinds)

    @property
    def mixed_layers(self) -> bool:
        """Do layers differ in window or RoPE (Gemma 2/3)?  The layer loop then picks each
        layer's variant by its index (models/llama.py)."""
        return self.layer_kinds is not None and len(set(self.layer_kinds)) > 1

    def _check_moe(self) -> None:
        moe = self.architecture in MOE_ARCHITECTURES
        if not moe:
            if self.num_experts:
                raise ValueError(f"ModelConfig.num_experts={self.num_experts} on architecture "
                                 f"{self.architecture!r}, which has a dense MLP")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int for a "
                                 f"{self.architecture} model, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} is "
                             f"more than num_experts={self.num_experts}")
        shared = self.shared_expert_intermediate_size
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"ModelConfig.shared_expert_intermediate_size must be an int >= 0, "
                             f"got {shared!r}")
        if self.quantization is not None:
            raise ValueError(f"ModelConfig.quantization={self.quantization!r}: quantized weights "
                             f"are not supported for mixture-of-experts models yet")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_params(self) -> int:
        e, f, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = e * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.is_moe:   # router, experts, shared expert and its gate
            mlp = e * self.num_experts + 3 * e * self.moe_intermediate_size * self.num_experts
            if self.shared_expert_intermediate_size:
                mlp += 3 * e * self.shared_expert_intermediate_size + e
        else:
            mlp = 3 * e * f
        per_layer = attn + mlp + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + layers * per_layer + e + head

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def for_context(self, max_model_len: int) -> "ModelConfig":
        """The config served at a context of `max_model_len` tokens: LongRoPE takes its short
        factors when that fits in original_max_position_embeddings (models/rope.py)."""
        rs = self.rope_scaling
        if rs is None or rs.kind != "longrope" or max_model_len >= self.max_position_embeddings:
            return self
        return self.replace(max_position_embeddings=max_model_len)

    def first_layers(self, n: int) -> "ModelConfig":
        """The config of this model's first `n` layers (a draft, a startup probe)."""
        kinds = None if self.layer_kinds is None else self.layer_kinds[:n]
        return self.replace(num_layers=n, layer_kinds=kinds)

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
        if self.layer_kinds is not None:
            d["layer_kinds"] = list(self.layer_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            rs = dict(d["rope_scaling"])
            for name in ("short_factor", "long_factor"):
                if rs.get(name) is not None:
                    rs[name] = tuple(float(f) for f in rs[name])
            d["rope_scaling"] = RopeScaling(**rs)
        if d.get("layer_kinds") is not None:
            d["layer_kinds"] = tuple(d["layer_kinds"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(float(f) for f in d["rope_freq_factors"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
