"""ModelConfig: every architectural choice of a normlab model as one named, validated field.

Nothing in `model/` keys off a model's name: a preset is only a set of field values, and every
behavioural difference between Llama, Qwen3, OLMo 2, GPT-2 and the original Transformer is one of
the fields below.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from model.mlp import MLPS  # the MLP registry: valid names, matrices per MLP
from model.mup import PARAMETRIZATIONS  # standard | mup: see model/mup.py
from model.norms import NORMS  # the norm registry: valid names, parameters per norm
from model.qk_norm import QK_NORM_KINDS, QK_NORMS, qk_norm_params  # QK-norm scopes and kinds: model/qk_norm.py
from model.residual import PLACEMENTS  # the placement registry: valid names, norms per sublayer, final norm
from model.rope import RopeScaling
from model.softmax import SINKS  # attention sinks: model/softmax.py
from model.validation import check_attention, check_choice, check_dyt_alpha, check_positive, check_stream

NORM_CASTS = ("llama", "gemma")
ATTN_GATES = ("none", "head", "elementwise")
FINAL_NORMS = ("auto", True, False)
INITS = ("normal", "scaled", "depth", "zero", "xavier")
KERNELS = ("auto", "triton", "torch")
ROPE_TYPES = ("default", "llama3")

# Structure only; sizes always come from overrides (or the small defaults below).
PRESETS: dict[str, dict[str, Any]] = {
    # Llama 2/3: pre-norm RMSNorm, no QK-norm, untied embeddings, no biases.
    "llama": dict(norm="rmsnorm", placement="pre", qk_norm="none", bias=False, norm_cast="llama"),
    # Qwen3: Llama plus an RMSNorm over head_dim on every query and key head, before RoPE.
    "qwen3": dict(norm="rmsnorm", placement="pre", qk_norm="head", bias=False, norm_cast="llama"),
    # OLMo 2: norms on the sublayer outputs (x + N(f(x))) and QK-norm over the whole projection;
    # RMSNorm multiplies by its gain in fp32 before casting.
    "olmo2": dict(norm="rmsnorm", placement="output", qk_norm="full", bias=False, norm_cast="gemma"),
    # GPT-2: pre-norm LayerNorm with biases, tied embeddings.
    "gpt2": dict(norm="layernorm", placement="pre", qk_norm="none", bias=True, tie_embeddings=True),
    # The original Transformer (Vaswani et al. 2017) / BERT: post-norm LayerNorm.
    "post": dict(norm="layernorm", placement="post", qk_norm="none", bias=True),
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The architecture of a decoder-only Transformer. Frozen: derive new configs with `replace`."""

    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    ffn_dim: int | None = None  # None: SwiGLU's 8/3·dim rounded up to a multiple of 64
    max_seq_len: int = 256
    head_dim: int | None = None  # per-head width; None: dim // n_heads (Qwen3-0.6B: 128 with dim 1024, 16 heads)
    rope_theta: float = 10000.0
    # Llama 3.1+ RoPE scaling (`rope_type: llama3`): long wavelengths divided by `rope_factor`, short ones kept,
    # a smooth blend between; the rope_* numbers below are its parameters and are ignored by "default".
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False
    bias: bool = False  # biases in linear layers and in LayerNorm
    mlp: str = "swiglu"  # swiglu | relu | gelu: see model/mlp.py
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    # norm="dyt"/"derf": the initial α of γ·tanh(α x) + β / γ·erf(α x + s) + β (0.5: Zhu et al. 2025's default); or
    # per location {attn, mlp, final} as the DyT authors' LLaMA recipe (7B: 0.8, 0.2, 0.2; model/norms.py)
    dyt_alpha: float | dict[str, float] = 0.5
    norm_offset: bool = False  # Gemma-style gain: stored as w, applied as (1 + w)
    norm_cast: str = "llama"
    placement: str = "pre"
    qk_norm: str = "none"  # none | head | full | qkv (head plus the values: HybridNorm): see model/qk_norm.py
    qk_norm_kind: str = "auto"  # auto (the block norm) | rmsnorm | layernorm | l2 (QKNorm's unit q, k · learned g)
    sub_norm: bool = False  # Sub-LN (Magneto): a norm before the attention output and the MLP down projection
    attn_gate: str = "none"  # none | head | elementwise: σ(x W_g) on the attention output (Qiu et al. 2025, G1)
    attn_sink: str = "none"  # none | learnable (gpt-oss) | off_by_one (softmax₁): a sink logit (model/softmax.py)
    final_norm: str | bool = "auto"  # auto: whatever the top layer's MLP placement needs
    norm_affine: bool = True  # False: every norm without its gain and bias (weightless; model/norms.py)
    # ---- the residual stream: scalars and per-sublayer / per-depth placements (model/residual.py) ----
    # α: each sublayer's stream term is α·x (pre: α·x + f(N(x)), post: N(α·x + f(x)), ...). "deepnorm": DeepNet's
    # decoder-only α = (2L)^¼, with the v/o/MLP init × β = (8L)^-¼ (Wang et al. 2022, arXiv 2203.00555)
    residual_scale: float | str = 1.0
    branch_scale: str = "none"  # none | scalar | vector: a learnable g on each sublayer's update before the add
    branch_scale_init: float = 0.0  # g at init: 0 is ReZero/SkipInit; LayerScale's ε: 0.1 up to 18 layers, then 1e-5…
    norm_depth_scale: bool = False  # LayerNorm Scaling (Sun et al. 2025): layer l's pre-norm output × 1/√l
    placement_mlp: str | None = None  # the MLP sublayer's placement; None: `placement` (HybridNorm: post + none)
    mix_ln: float = 0.0  # Mix-LN (Li et al. 2024): the lowest ⌊mix_ln·L⌋ layers post-norm (the paper's α: 0.25)
    embed_norm: bool = False  # a norm on the token embeddings (BLOOM; OLMo-core's Peri-LN ladder)
    embed_scale: float | str = 1.0  # the token embeddings × this; "sqrt_dim": × √dim (Gemma)
    init: str = "normal"
    init_std: float = 0.02
    kernels: str = "auto"  # which norm implementation runs: see model/kernels
    logit_softcap: float | None = None  # c: final logits c·tanh(x/c) (Gemma 2); None: off
    attn_softcap: float | None = None  # c: attention scores c·tanh(s/c) (Gemma 2); runs math attention, not SDPA
    parametrization: str = "standard"  # standard | mup: init, LR, logit and attention multipliers (model/mup.py)
    mup_base_width: int = 256  # mup: the width whose hyper-parameters transfer (multipliers are 1 there)
    # mup: the base model's head dim D₀ (scores · √D₀/D). None: mup_base_width / n_heads (the head dim grows with
    # the width); required with an explicit head_dim — its own value if it stays fixed as the width grows
    mup_base_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            check_positive(name, getattr(self, name))
        if self.head_dim is None:  # resolved here, so the saved config always states the width it ran with
            if self.dim % self.n_heads:
                raise ValueError(f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads} "
                                 "(or give head_dim)")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        check_positive("head_dim", self.head_dim)
        self._check_rope()
        if self.n_kv_heads is not None:
            check_positive("n_kv_heads", self.n_kv_heads)
        if self.ffn_dim is not None:
            check_positive("ffn_dim", self.ffn_dim)
        check_choice("mlp", self.mlp, tuple(MLPS))
        check_choice("norm", self.norm, tuple(NORMS))
        check_choice("norm_cast", self.norm_cast, NORM_CASTS)
        check_choice("placement", self.placement, tuple(PLACEMENTS))
        check_attention(self, QK_NORMS, QK_NORM_KINDS, ATTN_GATES, SINKS)
        check_choice("final_norm", self.final_norm, FINAL_NORMS)
        check_choice("init", self.init, INITS)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("parametrization", self.parametrization, PARAMETRIZATIONS)
        check_positive("mup_base_width", self.mup_base_width)
        if self.mup_base_head_dim is not None:
            check_positive("mup_base_head_dim", self.mup_base_head_dim)
        elif self.parametrization == "mup":
            self._check_mup_head_dim()
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads} (GQA groups)"
            )
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("ModelConfig.norm_eps, init_std and rope_theta must be positive")
        check_dyt_alpha(self)
        check_stream(self)
        for name in ("logit_softcap", "attn_softcap"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
                raise ValueError(f"ModelConfig.{name}={cap!r} must be a positive number or None (off)")
        if self.norm_offset and (self.norm != "rmsnorm" or not self.norm_affine):
            raise ValueError("ModelConfig.norm_offset=True is only defined for norm='rmsnorm' with norm_affine=True "
                             "(a Gemma-style gain)")

    def _check_mup_head_dim(self) -> None:
        """μP's attention scale needs the base model's head dim; derived from the base width only when the head
        dim is dim / n_heads (model/mup.py)."""
        if not self.head_dim_follows_width:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} is not dim/n_heads, so under parametrization='mup' set "
                f"mup_base_head_dim (the base model's head dim for the attention scale √D₀/D): {self.head_dim} "
                f"if the head dim stays fixed as the width grows, or the base width's head dim if it grows with it")
        if self.mup_base_width % self.n_heads:
            raise ValueError(f"ModelConfig.mup_base_width={self.mup_base_width} must be divisible by "
                             f"n_heads={self.n_heads} (μP's attention scale uses the base width's head dim; "
                             "or set mup_base_head_dim)")

    def _check_rope(self) -> None:
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        if self.rope_type == "llama3":
            check_positive("rope_original_max_seq_len", self.rope_original_max_seq_len)
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor or self.rope_factor <= 0:
                raise ValueError(f"ModelConfig rope_type='llama3' needs rope_factor > 0 and 0 < "
                                 f"rope_low_freq_factor ({self.rope_low_freq_factor}) < rope_high_freq_factor "
                                 f"({self.rope_high_freq_factor})")

    # ---- derived values ------------------------------------------------------------------------
    @property
    def rope_scaling(self) -> RopeScaling | None:
        """The RoPE frequency scaling `model.rope` applies, or None for plain RoPE."""
        if self.rope_type == "default":
            return None
        return RopeScaling(self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_seq_len)

    @property
    def head_dim_follows_width(self) -> bool:
        """True when head_dim is dim / n_heads (the default), so it changes with dim and n_heads."""
        return self.head_dim == self.dim // self.n_heads and not self.dim % self.n_heads

    @property
    def n_post_layers(self) -> int:
        """Mix-LN's post-norm layers, the lowest ⌊mix_ln·L⌋ (the ε keeps 0.3·10 = 3.0000000000000004 at 3)."""
        return math.floor(self.mix_ln * self.n_layers + 1e-9)

    def sublayer_placements(self, layer_id: int) -> tuple[str, str]:
        """The placements (names in PLACEMENTS) of layer `layer_id`'s attention and MLP sublayers."""
        if layer_id < self.n_post_layers:
            return "post", "post"
        return self.placement, self.placement_mlp or self.placement

    @property
    def residual_alpha(self) -> float:
        """α on the stream term of every sublayer: `residual_scale`, or DeepNet's decoder-only (2L)^¼."""
        return (2 * self.n_layers) ** 0.25 if self.residual_scale == "deepnorm" else float(self.residual_scale)

    @property
    def deepnorm_beta(self) -> float | None:
        """DeepNet's decoder-only β = (8L)^-¼ on the value, output and MLP matrices' init; None without it."""
        return (8 * self.n_layers) ** -0.25 if self.residual_scale == "deepnorm" else None

    @property
    def embed_multiplier(self) -> float:
        """The token embeddings' multiplier: `embed_scale`, or √dim for "sqrt_dim"."""
        return math.sqrt(self.dim) if self.embed_scale == "sqrt_dim" else float(self.embed_scale)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        """MLP width: `ffn_dim` when given; else 4·dim for a two-matrix MLP (relu, gelu), and for SwiGLU
        8/3·dim rounded up to a multiple of 64 (three matrices: keeps FLOPs ≈ a 4·dim GELU MLP)."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        if MLPS[self.mlp].n_matrices == 2:
            return 4 * self.dim
        return 64 * -(-(8 * self.dim // 3) // 64)

    # ---- constructors --------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A family's structure (see PRESETS) with sizes and any other field taken from `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            valid = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}; valid: {valid}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes`. A head_dim that was derived (dim // n_heads) is derived again when dim or
        n_heads change; one set to another width is kept."""
        if self.head_dim_follows_width and "head_dim" not in changes and {"dim", "n_heads"} & set(changes):
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- accounting (from the config, so it is right even when parameters are sharded) ----------
    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count computed from the config; equals `sum(p.numel())` of an unsharded model."""
        d, hd, L = self.dim, self.head_dim, self.n_layers
        q, kv = self.n_heads * hd, self.kv_heads * hd
        b = 1 if self.bias else 0
        attn = d * (q + 2 * kv) + q * d + b * (q + 2 * kv + d)
        n_in = MLPS[self.mlp].n_matrices - 1  # matrices reading the input (gate and up, or up)
        mlp = (n_in + 1) * d * self.hidden_dim + b * (n_in * self.hidden_dim + d)
        norm_params = NORMS[self.norm].num_params
        sub = norm_params(self, q) + norm_params(self, self.hidden_dim) if self.sub_norm else 0
        gate = {"none": 0, "head": self.n_heads, "elementwise": q}[self.attn_gate] * (d + b)
        sink = self.n_heads if self.attn_sink == "learnable" else 0
        branch = {"none": 0, "scalar": 1, "vector": d}[self.branch_scale]
        placements = [p for i in range(L) for p in self.sublayer_placements(i)]  # one per sublayer
        norms = sum(len(PLACEMENTS[p].norms) for p in placements) * norm_params(self, d) + branch * len(placements)
        blocks = L * (attn + mlp + qk_norm_params(self) + sub + gate + sink) + norms
        final = norm_params(self, d) * (self.has_final_norm + self.embed_norm)
        emb = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total = blocks + final + emb + head
        return total if include_embeddings else total - emb

    @property
    def has_final_norm(self) -> bool:
        if self.final_norm == "auto":  # the top layer's MLP placement knows whether it needs one
            return PLACEMENTS[self.sublayer_placements(self.n_layers - 1)[1]].needs_final_norm
        return bool(self.final_norm)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (non-embedding matmuls, forward + backward) plus causal attention.

        The attention term is 6·L·T·dim (QKᵀ and AV, 2 FLOPs per multiply-add, ×3 for backward, halved by
        the causal mask), as in the PaLM appendix. N excludes the embedding lookup but includes the LM head.
        """
        n_matmul = self.num_params(include_embeddings=False) if not self.tie_embeddings else self.num_params()
        return 6.0 * n_matmul + 6.0 * self.n_layers * seq_len * self.dim
