"""The model spec: the one small description of a decoder-only transformer that every stage shares.

The compiler's families map a checkpoint's config onto it; the bundle's manifest stores it; the
executors (cpu and cuda) and the kernel templates read nothing else about the architecture.

Canonical tensor names in a bundle (i = layer index):
  embed                    [vocab, hidden]
  layers.i.attn_norm       [hidden]                 RMSNorm weight, offset already folded in
  layers.i.qkv             [(H + 2*KV) * head_dim, hidden]   q, k, v rows stacked in that order
  layers.i.qkv_bias        [(H + 2*KV) * head_dim]  when qkv_bias
  layers.i.q_norm          [head_dim]               when qk_norm
  layers.i.k_norm          [head_dim]               when qk_norm
  layers.i.o               [hidden, H * head_dim]
  layers.i.post_attn_norm  [hidden]                 when sandwich_norm (gemma3)
  layers.i.ffn_norm        [hidden]
  layers.i.gate_up         [2 * intermediate, hidden]  gate rows, then up rows
  layers.i.down            [hidden, intermediate]
  layers.i.post_ffn_norm   [hidden]                 when sandwich_norm
  final_norm               [hidden]
  lm_head                  [vocab, hidden]          absent when tie_embeddings
Linear weights are [out, in] like torch.nn.Linear. Norm weights are stored as the factor the
normalised activation is multiplied by (gemma's `1 + w` is folded in at compile time).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"               # none | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0     # llama3 only
    high_freq_factor: float = 4.0    # llama3 only
    original_max_position: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelSpec:
    family: str                      # llama | mistral | qwen2 | qwen3 | gemma3
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    rope_theta: float
    max_position: int
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False      # gemma3: norms after attention and MLP too
    activation: str = "silu"         # silu | gelu_tanh (gate activation of the gated MLP)
    embed_scale: float = 1.0         # gemma3: sqrt(hidden)
    attn_scale: float = 0.0          # softmax scale; 0 means 1/sqrt(head_dim)
    sliding_window: int = 0          # 0: none
    layer_kinds: tuple[str, ...] = ()  # per layer: "full" | "sliding"; empty means all full
    rope_theta_local: float = 0.0    # gemma3: sliding layers use this base and no rope_scaling
    final_softcap: float = 0.0       # 0: none

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    def rope_for(self, layer: int) -> tuple[float, RopeScaling]:
        """(base, scaling) of one layer's RoPE."""
        if self.rope_theta_local and self.kind(layer) == "sliding":
            return self.rope_theta_local, RopeScaling()
        return self.rope_theta, self.rope_scaling

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of every linear weight of one layer."""
        return {
            "qkv": (self.q_dim + 2 * self.kv_dim, self.hidden),
            "o": (self.hidden, self.q_dim),
            "gate_up": (2 * self.intermediate, self.hidden),
            "down": (self.hidden, self.intermediate),
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a bundle of this model holds, by canonical name."""
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab_size, self.hidden)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm"] = (self.hidden,)
            for name, shape in self.linear_shapes().items():
                shapes[p + name] = shape
            if self.qkv_bias:
                shapes[p + "qkv_bias"] = (self.q_dim + 2 * self.kv_dim,)
            if self.qk_norm:
                shapes[p + "q_norm"] = (self.head_dim,)
                shapes[p + "k_norm"] = (self.head_dim,)
            shapes[p + "ffn_norm"] = (self.hidden,)
            if self.sandwich_norm:
                shapes[p + "post_attn_norm"] = (self.hidden,)
                shapes[p + "post_ffn_norm"] = (self.hidden,)
        shapes["final_norm"] = (self.hidden,)
        if not self.tie_embeddings:
            shapes["lm_head"] = (self.vocab_size, self.hidden)
        return shapes

    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        d["layer_kinds"] = tuple(d.get("layer_kinds", ()))
        return cls(**d)


def is_linear(name: str) -> bool:
    """Linear (matrix) weights are the ones the quantizer may turn into NVFP4."""
    return name.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down") or name in ("embed", "lm_head")
