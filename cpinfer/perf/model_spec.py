"""The shape of a transformer for the performance model (`ModelSpec`): layers, heads, windows and chunks, experts,
latent attention, and the parameter and KV-cache counts derived from them; it knows nothing about hardware. Below
the catalog of built-in shapes (`model_catalog.py`) and the readers of `config.json` files (`models.py`)."""
from __future__ import annotations

from dataclasses import dataclass

from cpinfer.utils import check_positive

LINEAR_KINDS = ("gdn", "kda")  # the recurrent mixers the planner prices (Gated DeltaNet, Kimi Delta Attention)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    hidden: int          # D, model dimension
    n_heads: int         # N_H, query heads
    n_kv_heads: int      # N_KV, key/value heads
    head_dim: int        # D_H (need not be hidden / n_heads: Qwen3, Gemma 3)
    ffn_dim: int         # gated-MLP intermediate size (SwiGLU / GeGLU: gate, up, down)
    vocab: int
    tie_embeddings: bool = False
    source: str = ""     # where the numbers come from
    window: int = 0          # sliding window of the windowed layers (a key j visible to query i iff i - j < window)
    window_layers: int = 0   # how many of the n_layers use it (Gemma 3: 5 of every 6; Mistral v0.1: all)
    max_context: int = 0     # max_position_embeddings of the config (0: not stated)
    local: str = "sliding"   # what `window` is: a "sliding" window, or "chunked" attention (Llama 4: a query sees
    #                          only keys of its own chunk of `window` positions)
    n_experts: int = 0       # routed experts of each sparse MLP layer (0: a dense model)
    experts_per_tok: int = 0  # k: experts each token goes through
    expert_ffn_dim: int = 0   # gated-MLP intermediate size of one expert
    shared_ffn_dim: int = 0   # a shared expert every token goes through (Qwen2-MoE, Llama 4; 0: none)
    moe_layers: int = 0       # how many of the n_layers are sparse (the others are dense MLPs of ffn_dim)
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2; 0: GQA): one cached KV head of kv_lora_rank +
    # qk_rope_head_dim per token, the same on every TP rank; attention runs absorbed (head_dim is that width)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0      # 0: full-rank queries
    router_bias: bool = False  # DeepSeek-V3 / Kimi K2: a selection-only bias of n_experts per sparse layer
    # linear-attention hybrids (0: none): `linear_layers` of the n_layers are a recurrence with a fixed-size state
    # per request and no KV cache — Gated DeltaNet ("gdn": Qwen3-Next, Qwen3.5; value heads repeat the key heads)
    # or Kimi Delta Attention ("kda": Kimi Linear; linear_k_heads = linear_v_heads, linear_k_dim = linear_v_dim)
    linear_layers: int = 0
    linear_kind: str = ""
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0      # the causal depthwise conv1d's kernel (its last kernel - 1 inputs are state too)
    attn_output_gate: bool = False  # Qwen3-Next / Qwen3.5 gated attention: q_proj doubled into a sigmoid gate
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; 0: none): a lightning indexer of index_heads x index_dim scores
    # every earlier key for each query (O(S^2) at that small width), attention reads the index_topk best (O(S k));
    # each token caches an indexer key of index_dim beside the latent
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0

    def __post_init__(self) -> None:
        for what in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab"):
            check_positive(getattr(self, what), f"model {self.name!r}: {what}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention")
        for what in ("window", "window_layers", "max_context"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {what} must be a non-negative integer, got {value!r}")
        if self.window_layers > self.n_layers:
            raise ValueError(f"model {self.name!r}: window_layers ({self.window_layers}) exceeds n_layers "
                             f"({self.n_layers})")
        if bool(self.window) != bool(self.window_layers):
            raise ValueError(f"model {self.name!r}: a sliding window needs both window ({self.window}) and "
                             f"window_layers ({self.window_layers}) positive, or neither")
        if self.local not in ("sliding", "chunked"):
            raise ValueError(f"model {self.name!r}: local must be 'sliding' or 'chunked', got {self.local!r}")
        self._check_experts()
        self._check_linear()
        mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.kv_lora_rank and not all(getattr(self, w) > 0 for w in mla):
            raise ValueError(f"model {self.name!r}: MLA needs {', '.join(mla)} all positive")
        dsa = (self.index_heads, self.index_dim, self.index_topk)
        if any(dsa) and not (all(v > 0 for v in dsa) and self.mla):
            raise ValueError(f"model {self.name!r}: DeepSeek sparse attention needs MLA and index_heads, index_dim, "
                             f"index_topk all positive (got {dsa})")
        if self.kv_lora_rank and (self.n_kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim):
            raise ValueError(f"model {self.name!r}: MLA attends over one KV head of kv_lora_rank + qk_rope_head_dim "
                             f"(n_kv_heads 1, head_dim {self.kv_lora_rank + self.qk_rope_head_dim})")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def indexer_params(self) -> int:
        """A DSA layer's indexer (replicated on every TP rank): wq_b from the query latent, wk and weights_proj from
        the hidden."""
        if not self.dsa:
            return 0
        return (self.q_lora_rank or self.hidden) * self.index_heads * self.index_dim + \
            self.hidden * (self.index_dim + self.index_heads)

    @property
    def attn_replicated_params(self) -> int:
        """Attention weights every TP rank holds whole: MLA's latent path (q_a_proj, kv_a_proj_with_mqa); else 0."""
        if not self.mla:
            return 0
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim) + self.indexer_params

    def _check_experts(self) -> None:
        names = ("n_experts", "experts_per_tok", "expert_ffn_dim", "shared_ffn_dim", "moe_layers")
        for what in names:
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {what} must be a non-negative integer, got {value!r}")
        if not self.moe_layers:
            return
        if self.moe_layers > self.n_layers:
            raise ValueError(f"model {self.name!r}: moe_layers ({self.moe_layers}) exceeds n_layers ({self.n_layers})")
        if not (self.n_experts and self.expert_ffn_dim and 0 < self.experts_per_tok <= self.n_experts):
            raise ValueError(f"model {self.name!r}: sparse layers need n_experts, expert_ffn_dim and "
                             f"0 < experts_per_tok <= n_experts (got {self.n_experts}, {self.expert_ffn_dim}, "
                             f"{self.experts_per_tok})")

    def _check_linear(self) -> None:
        if not self.linear_layers:
            return
        if self.linear_layers + self.window_layers >= self.n_layers:
            raise ValueError(f"model {self.name!r}: linear_layers ({self.linear_layers}) + window_layers "
                             f"({self.window_layers}) must leave at least one full-attention layer of "
                             f"{self.n_layers}")
        if self.linear_kind not in LINEAR_KINDS:
            raise ValueError(f"model {self.name!r}: linear_kind must be one of {', '.join(LINEAR_KINDS)}, got "
                             f"{self.linear_kind!r}")
        for what in ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "linear_conv"):
            check_positive(getattr(self, what), f"model {self.name!r}: {what}")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"model {self.name!r}: linear_v_heads ({self.linear_v_heads}) must be a multiple of "
                             f"linear_k_heads ({self.linear_k_heads})")
        if self.linear_kind == "kda" and (self.linear_k_heads != self.linear_v_heads
                                          or self.linear_k_dim != self.linear_v_dim):
            raise ValueError(f"model {self.name!r}: KDA heads have as many value as key heads and channels")

    @property
    def full_layers(self) -> int:  # layers that attend to the whole context
        return self.n_layers - self.window_layers - self.linear_layers

    @property
    def attn_layers(self) -> int:  # layers with attention (and a KV cache): all but a hybrid's recurrent ones
        return self.n_layers - self.linear_layers

    # The recurrent layers of a hybrid (per layer; see cpinfer/model/recurrent/).
    @property
    def linear_conv_channels(self) -> int:
        """Channels of the causal conv1d: q, k and v before it (GDN: 2 Hk Dk + Hv Dv; KDA: 3 H D)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def linear_state_elems(self) -> int:
        """One request's recurrent state of one layer: Hv x Dk x Dv (kept fp32)."""
        return self.linear_v_heads * self.linear_k_dim * self.linear_v_dim

    def linear_state_bytes(self, tp: int = 1, conv_bytes: int = 2) -> int:
        """One request's state bytes on one TP rank over every recurrent layer: the fp32 state and the conv tail
        (kernel - 1 pre-conv rows of `conv_bytes` elements), the heads split over TP ranks."""
        per_layer = self.linear_state_elems * 4 + (self.linear_conv - 1) * self.linear_conv_channels * conv_bytes
        return self.linear_layers * per_layer // tp

    @property
    def linear_proj_dims(self) -> tuple[int, int, int]:
        """(output width of the input projections from hidden, of the low-rank second stages, of the value
        path into out_proj). GDN: q k v, z, b, a; KDA: q k v, b, f_a and g_a (head_dim wide) then f_b and g_b."""
        kd, vd = self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        if self.linear_kind == "kda":
            return 3 * kd + self.linear_v_heads + 2 * self.linear_k_dim, 2 * kd, vd
        return 2 * kd + 2 * vd + 2 * self.linear_v_heads, 0, vd

    @property
    def linear_params(self) -> int:
        """One recurrent layer's weights: projections, conv, decay / dt parameters and the output norm."""
        into, second, vd = self.linear_proj_dims
        low_rank = second * self.linear_k_dim if second else 0  # KDA's f_b / g_b [H D, D]
        if self.linear_kind == "kda":  # A_log per head, dt_bias per channel, o_norm over a head
            extra = self.linear_v_heads + self.linear_k_heads * self.linear_k_dim + self.linear_v_dim
        else:  # A_log, dt_bias per value head, the gated norm over a head
            extra = 2 * self.linear_v_heads + self.linear_v_dim
        return self.hidden * into + low_rank + self.linear_conv_channels * self.linear_conv + vd * self.hidden + extra

    # Parameter counts (elements), per layer unless stated.
    @property
    def attn_params(self) -> int:  # Wq, Wk, Wv, Wo (MLA: q_a / q_b or q_proj, kv_a, kv_b, o_proj)
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (self.q_lora_rank or self.hidden) * self.n_heads * qk
            kv_b = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return self.attn_replicated_params + q + kv_b + self.n_heads * self.v_head_dim * self.hidden
        q_heads = self.n_heads * (2 if self.attn_output_gate else 1)
        return self.hidden * (q_heads + 2 * self.n_kv_heads) * self.head_dim + \
            self.n_heads * self.head_dim * self.hidden

    @property
    def ffn_params(self) -> int:  # SwiGLU: gate, up, down (a dense layer)
        return 3 * self.hidden * self.ffn_dim

    def moe_layer_params(self, experts: int) -> int:
        """A sparse layer's weights through `experts` routed experts: theirs, the shared expert's and the router."""
        return 3 * self.hidden * (experts * self.expert_ffn_dim + self.shared_ffn_dim) + self.n_experts * self.hidden

    @property
    def ffn_params_total(self) -> int:
        """Every MLP weight of every layer (what memory holds)."""
        return (self.n_layers - self.moe_layers) * self.ffn_params + self.moe_layers * self.moe_layer_params(
            self.n_experts)

    @property
    def ffn_params_active(self) -> int:
        """The MLP weights one token goes through over all layers (what its FLOPs use)."""
        return (self.n_layers - self.moe_layers) * self.ffn_params + self.moe_layers * self.moe_layer_params(
            self.experts_per_tok)

    @property
    def active_ffn_dim(self) -> float:
        """The intermediate width one token sees per layer, averaged over layers (elementwise passes)."""
        sparse = self.experts_per_tok * self.expert_ffn_dim + self.shared_ffn_dim
        return ((self.n_layers - self.moe_layers) * self.ffn_dim + self.moe_layers * sparse) / self.n_layers

    @property
    def embed_params(self) -> int:  # input embedding + LM head (once if tied)
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def norm_params(self) -> int:
        """Every norm weight: two per layer and the final one (MLA: also the q / kv latent norms), and
        DeepSeek-V3's router bias."""
        latent = self.q_lora_rank + self.kv_lora_rank if self.mla else 0
        bias = self.moe_layers * self.n_experts if self.router_bias else 0
        return self.n_layers * (2 * self.hidden + latent) + self.hidden + bias

    @property
    def params(self) -> int:
        """W of the paper: every weight, norms included (a mixture of experts: all experts, for memory)."""
        return self.attn_layers * self.attn_params + self.linear_layers * self.linear_params + \
            self.ffn_params_total + self.embed_params + self.norm_params

    @property
    def active_params(self) -> int:
        """The weights one token goes through (= params for a dense model; for FLOPs)."""
        return self.params - self.ffn_params_total + self.ffn_params_active

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads a TP rank holds; with tp > N_KV each KV head is replicated (paper §4.2.2)."""
        check_positive(tp, "tp")
        if self.n_heads % tp:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be divisible by tp ({tp})")
        if self.mla:  # the one latent head, on every TP rank
            return 1
        if self.n_kv_heads % tp == 0:
            return self.n_kv_heads // tp
        if tp % self.n_kv_heads == 0:
            return 1
        raise ValueError(f"model {self.name!r}: tp ({tp}) must divide n_kv_heads ({self.n_kv_heads}) "
                         f"or be a multiple of it")

    def kv_bytes_per_token(self, tp: int, kv_bytes: int, scale_bytes: int = 0) -> int:
        """KV cache bytes per token per GPU over all layers (K and V; MLA: the latent and rotary key, once;
        `scale_bytes` per row: FP8 KV's scale; DSA: the indexer key after the latent, `index_row_bytes`)."""
        return self.kv_parts * self.attn_layers * self.kv_heads_per_gpu(tp) * (self.head_dim * kv_bytes + scale_bytes) \
            + self.attn_layers * self.index_row_bytes(kv_bytes)

    def index_row_bytes(self, kv_bytes: int) -> int:
        """A DSA token's indexer key per layer: index_dim elements of the KV dtype; in FP8 with its 4-byte scale (the
        engine's row when the checkpoint's indexer is FP8, as DeepSeek-V3.2's release)."""
        return self.index_dim * kv_bytes + (4 if kv_bytes == 1 and self.dsa else 0)

    @property
    def kv_parts(self) -> int:
        """Tensors a cached token is per KV head: 2 (K and V of head_dim) or 1 (MLA: the values are in the keys)."""
        return 1 if self.mla else 2

    def kv_bytes_per_head_layout(self, kv_bytes: int) -> int:
        """What the same model's cache would hold per token with per-head K/V (MLA expanded: H x (nope + rope) keys
        and H x v values per layer); = kv_bytes_per_token(1, .) for GQA."""
        if not self.mla:
            return self.kv_bytes_per_token(1, kv_bytes)
        per_layer = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return self.attn_layers * per_layer * kv_bytes
