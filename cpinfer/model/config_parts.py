"""The parts a `ModelConfig` is built from: one RoPE (`RopeConfig`), a sparse MLP block (`MoEConfig`), latent
attention (`MLAConfig`) and the names they accept. Below both `config.py` and the family readers (`families.py`),
which fill them from a `config.json`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cpinfer.utils import check_divisible, check_positive

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "ffn")
RECURRENT_LAYER_TYPES = ("linear_attention",)  # a recurrent mixer (`model/recurrent`), no KV cache
FFN_LAYER_TYPES = ("ffn",)  # Nemotron-H's MLP / MoE blocks: a layer with no token mixer (no KV, no state)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu2")
SCORING_FUNCS = ("softmax", "sigmoid")  # a router's expert scores from its logits
EXPERT_ACTIVATIONS = (*ACTIVATIONS, "swiglu_clamped")  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP block (`moe.py`): a router picks `top_k` of `num_experts` gated MLPs per token, optionally
    beside a shared expert. The layout fields say how the checkpoint stores the experts (parameter names and shapes
    stay Hugging Face's)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    scoring: str = "softmax"  # scores = softmax / sigmoid of the router logits; top-k of the scores
    norm_topk_prob: bool = False  # the k weights renormalised to sum to 1
    router_bias: bool = False  # gpt-oss: logits = x W^T + b
    router_name: str = "gate"  # "gate" (Qwen, Mixtral) or "router" (gpt-oss, Llama 4)
    weight_input: bool = False  # Llama 4 scales each expert's input by its weight; the others scale its output
    expert_bias: bool = False  # gpt-oss: experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702  # swiglu_clamped only
    swiglu_limit: float = 7.0  # swiglu_clamped only
    gate_up_interleaved: bool = False  # gpt-oss: gate and up columns alternate; else gate half, then up half
    transposed: bool = False  # experts stored [E, in, out] (gpt-oss, Llama 4) instead of [E, out, in]
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoints
    shared_intermediate_size: int = 0  # a shared expert every token goes through (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x w)
    shared_name: str = "shared_expert"  # the checkpoint's name of the shared expert (DeepSeek: "shared_experts")
    # DeepSeek routing: experts in n_group groups, only the topk_group best groups eligible (a group's score: the
    # sum of its top 2 choice scores, "top2_sum" (V3), or its best, "max" (V2)); a selection-only bias
    # (e_score_correction_bias) on the choice scores; the k weights times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    score_correction_bias: bool = False
    correction_bias_on_block: bool = False  # MiniMax-M2 stores it as `<mlp>.e_score_correction_bias`, not the gate's
    routed_scaling_factor: float = 1.0
    gated: bool = True  # False: each expert is down(act(up(x))) with `experts.up_proj` [E, I, H] (Nemotron-H)
    latent_size: int = 0  # > 0: experts on fc1_latent_proj(x) [latent], their sum through fc2_latent_proj (Nemotron 3)
    latent_bias: bool = False  # the latent projections' biases

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            check_positive(getattr(self, name), f"moe {name}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        for name, allowed in (("scoring", SCORING_FUNCS), ("hidden_act", EXPERT_ACTIVATIONS),
                              ("router_name", ("gate", "router"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unsupported expert {name} {getattr(self, name)!r}: cpinfer supports {allowed}")
        if self.latent_size < 0:
            raise ValueError(f"moe_latent_size must be positive, got {self.latent_size}")
        if self.shared_intermediate_size < 0:
            raise ValueError(f"shared expert intermediate size must be >= 0, got {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("a shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        if len(self.expert_proj_names) != 3:
            raise ValueError(f"expert_proj_names must name (gate, up, down), got {self.expert_proj_names}")
        self._check_groups()

    def _check_groups(self) -> None:
        check_positive(self.n_group, "moe n_group")
        check_divisible(self.num_experts, self.n_group, "the number of routed experts", "n_group")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group = {self.n_group}], got {self.topk_group}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"unsupported group score {self.group_score!r}: cpinfer supports 'top2_sum', 'max'")
        if self.n_group > 1 and self.group_score == "top2_sum" and self.num_experts // self.n_group < 2:
            raise ValueError("group-limited routing scores a group by its top 2 experts: each of the n_group "
                             f"groups needs >= 2 experts, got {self.num_experts // self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of the topk_group "
                             f"({self.topk_group}) eligible groups ({self.num_experts // self.n_group} each)")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor}")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 §2.1): per token one latent c (kv_lora_rank, normed) and one rotary
    key (qk_rope_head_dim) shared by every head; per head a no-RoPE query / key part (qk_nope_head_dim) and a value
    (v_head_dim) up-projected from c by kv_b_proj; queries through a low-rank q_a / q_b pair when q_lora_rank is set.
    The cache holds one KV head of width key_width whose first value_width channels are the values (the absorbed
    form's view); attention runs absorbed or expanded per forward (`mla.py`, `engine/mla_form.py`)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    softmax_scale: float = 0.0  # the original head's 1/sqrt(nope + rope) times YaRN's mscale^2 (0: without mscale)
    rope_interleaved: bool = True  # the rotary part rotates pairs (2i, 2i + 1) (V2, V3 rope_interleave)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive(getattr(self, name), name)
        if self.q_lora_rank is not None:
            check_positive(self.q_lora_rank, "q_lora_rank")
        check_divisible(self.qk_rope_head_dim, 2, "qk_rope_head_dim", "2 (RoPE rotates pairs)")
        if not self.softmax_scale:
            object.__setattr__(self, "softmax_scale", self.qk_head_dim ** -0.5)
        if not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise ValueError(f"MLA softmax_scale must be a positive number, got {self.softmax_scale}")

    @property
    def qk_head_dim(self) -> int:  # a query / key head of the original (non-absorbed) form
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def key_width(self) -> int:  # the one cached KV head per token: [latent c ; rotary key]
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def value_width(self) -> int:  # the values are the latent: the key's first kv_lora_rank channels
        return self.kv_lora_rank


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE as transformers defines it (`modeling_rope_utils.py`); unused fields stay None.

    `dynamic` is evaluated at factor x max_position_embeddings and `longrope` uses its long factors iff
    max_position_embeddings > original_max_position_embeddings: fixed choices, so cached keys never change
    (transformers re-evaluates both at the current sequence length; see docs/models.md).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None  # linear, dynamic, yarn, llama3; longrope (None: max / original)
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: explicit cos/sin scale (None: derived from factor)
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope
    # partial RoPE: the first int(head_dim * f) channels rotate (MiniMax-M2's rotary_dim); "proportional" (Gemma 4's
    # global layers) keeps the full head_dim's frequencies for the first int(f * head_dim // 2) pairs, zero after
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        t = self.rope_type
        if t not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {t!r}: cpinfer supports {ROPE_TYPES}")
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ValueError(f"rope_theta must be a positive finite number, got {self.theta}")
        if t in ("linear", "dynamic", "yarn", "llama3") and not (self.factor is not None and self.factor > 0):
            raise ValueError(f"{t} rope scaling needs a factor > 0, got {self.factor}")
        if t in ("yarn", "longrope", "llama3"):
            check_positive(self.original_max_position_embeddings, f"{t} rope scaling: original_max_position_embeddings")
        if t == "llama3" and not (self.low_freq_factor is not None and self.high_freq_factor is not None
                                  and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError("llama3 rope scaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if t == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope rope scaling needs short_factor and long_factor lists")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")


INDEXER_TYPES = ("full", "shared")  # a DSA layer runs its own indexer, or reuses the previous layer's selection


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA whose queries each read only the `index_topk` keys a
    lightning indexer scores highest (`model/indexer.py`): score(q, t) = sum_h w_h(q) relu(q_h · k_t / sqrt(d)) over
    `index_n_heads` heads of `index_head_dim` channels, the first `rope_dim` of which carry RoPE (pairs interleaved
    or half-split). `indexer_types` per layer: "full" (its own indexer) or "shared" (the previous layer's choice)."""

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_dim: int
    rope_interleaved: bool
    indexer_types: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            check_positive(getattr(self, name), name)
        if self.index_head_dim < self.rope_dim:
            raise ValueError(f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.rope_dim}): "
                             "the indexer's first qk_rope_head_dim channels carry RoPE")
        bad = sorted(set(self.indexer_types) - set(INDEXER_TYPES))
        if bad:
            raise ValueError(f"unsupported indexer_types {bad}: cpinfer supports {INDEXER_TYPES}")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a 'shared' layer reuses the previous layer's selection")
