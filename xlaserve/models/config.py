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

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The sparse mixture-of-experts families (models/moe.py): every decoder layer's MLP is a routed
# set of experts.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
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

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
        """From a Hugging Face `config.json` of a Llama, Mistral, Mixtral, Qwen2-MoE,
        Qwen3-MoE or OLMoE model."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id", 2)
        scaling = _rope_scaling_from_hf(hf.get("rope_scaling") or hf.get("rope_parameters"))
        max_pos = hf.get("max_position_embeddings", 4096)
        # A window no shorter than the context never hides a position: plain causal attention.
        window = hf.get("sliding_window") if model_type in ("mistral", "mixtral") else None
        window = None if window is None or window >= max_pos else int(window)
        theta = hf.get("rope_theta")
        if theta is None and isinstance(hf.get("rope_parameters"), dict):
            theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(theta or 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=(tuple(eos) if isinstance(eos, list) else ()
                           if eos is None else (eos,)),
            architecture=model_type,
            dtype=dtype,
            sliding_window=window,
            **_moe_from_hf(hf),
        )


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config.json (none for a dense model)."""
    kind = hf["model_type"]
    if kind not in MOE_ARCHITECTURES:
        return {}
    if kind == "mixtral":
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    if kind == "olmoe":
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"olmoe: clip_qkv={hf['clip_qkv']} is not supported")
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if hf.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"olmoe: head_dim={hf['head_dim']} must be hidden_size / "
                             f"num_attention_heads = {hidden // heads} (its q norm spans "
                             f"hidden_size)")
        return dict(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
                    qk_norm_span="all")
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(f"{kind}: decoder_sparse_step={step}, mlp_only_layers={dense}: "
                         f"models with dense layers among the MoE layers are not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{kind}: use_sliding_window=true is not supported")
    out = dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
               num_experts_per_tok=hf["num_experts_per_tok"],
               moe_intermediate_size=hf["moe_intermediate_size"],
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
                   attention_bias=bool(hf.get("qkv_bias", True)))
    else:
        out.update(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    return out


def _rope_scaling_from_hf(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )
