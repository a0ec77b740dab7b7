"""Multi-head latent attention (DeepSeek-V2 §2.1, also V3 / Kimi K2 / Moonlight), in two forms over one latent cache.

Per token the layer makes one latent c = norm(x W_DKV) [kv_lora_rank] and one rotary key k_r [qk_rope_head_dim],
shared by every head. Head h's key would be (c W_UK,h ; k_r) and its value c W_UV,h; folding W_UK,h into the query
(q_lat,h = q_nope,h W_UK,h^T, [kv_lora_rank]) gives q_h · k_h = (q_lat,h ; q_r,h) · (c ; k_r), so attention runs with
ONE KV head [c ; k_r] whose first kv_lora_rank channels are the values (v = k[..., :kv_lora_rank]), and each head's
output is up-projected by W_UV,h after the softmax (and after CP's merge: the merge is linear in the values). The
cache, the ring and the tiers carry kv_lora_rank + qk_rope_head_dim values per token, once.

The expanded form (`attn.mla_form == "expanded"`, chosen per forward by `mla_form.choose_form`) keeps that latent
in the cache and on the ring but attends with per-head keys and values: attention gets the ordinary query
(q_nope ; q_r) [H, nope + rope] and an `expand` callable that up-projects latent rows, c W_UK,h ⊕ k_r and c W_UV,h
(`kv_b_proj`, one GEMM per block of rows), wherever the rows are read: once per received ring block, once per
forward for a rank's own rows. Fewer FLOPs when many queries meet many keys (prefill); the absorbed form reads fewer
bytes (decode).

DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: `config.dsa`): the layer stays absorbed and also gives attention
its lightning indexer's rows (`indexer.py`; `index=None` on GLM's "shared" layers, which reuse the previous layer's
selection); attention reads each query's top-k latent rows (`engine/sparse_attention.py`).

No distributed code: under TP the query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj columns) are sliced
from outside and the latent path (q_a_proj, kv_a_proj_with_mqa, their norms) stays whole on every rank.
"""
from __future__ import annotations

from torch import Tensor, nn

from cpinfer.model.config import ModelConfig
from cpinfer.model.indexer import Indexer
from cpinfer.model.norms import RMSNorm
from cpinfer.model.rope import apply_rope, apply_rope_interleaved


class MLAttention(nn.Module):
    """One MLA layer with Hugging Face's parameter names (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        m, hidden, heads = config.mla, config.hidden_size, config.num_attention_heads
        self.layer_idx, self.m = layer_idx, m
        bias = config.qkv_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.key_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=config.o_bias)
        self.rope = apply_rope_interleaved if m.rope_interleaved else apply_rope
        self.sinks = None
        # DeepSeek sparse attention: an indexer on "full" layers; "shared" layers reuse the previous layer's top-k
        self.sparse = config.dsa is not None
        if self.sparse and config.dsa.indexer_types[layer_idx] == "full":
            self.indexer = Indexer(config)

    @property
    def num_heads(self) -> int:  # from the weights, so a TP-sliced kv_b_proj means fewer local heads
        return self.kv_b_proj.weight.shape[0] // (self.m.qk_nope_head_dim + self.m.v_head_dim)

    num_kv_heads = 1  # the latent: one KV head, whatever the query heads

    @property
    def key_width(self) -> int:
        return self.m.key_width

    @property
    def value_width(self) -> int:
        return self.m.value_width

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x [L, hidden] -> (q [L, H, nope + rope], the query latent [L, q_lora_rank] or None)."""
        if hasattr(self, "q_proj"):
            q, q_latent = self.q_proj(x), None
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        return q.view(x.shape[0], self.num_heads, self.m.qk_head_dim), q_latent  # (L may be 0 on a rank)

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, attn, q_scale: Tensor | None = None) -> Tensor:
        """x [L, hidden], cos/sin [L, rope/2] (None: NoPE) -> [L, hidden] (a partial sum when o_proj is TP-sliced).
        The form is the attention callable's `mla_form` ("absorbed" when it has none)."""
        m, n = self.m, x.shape[0]
        q, q_latent = self._queries(x)  # [L, H, nope + rope], [L, q_lora_rank]
        h = q.shape[1]
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)  # [L, rank + rope]
        c, k_rope = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # [L, rank]
        k_rope = k_rope.view(n, 1, m.qk_rope_head_dim)
        if cos is not None:  # (Kimi Linear's MLA layers are NoPE: the "rotary" key part stays as projected)
            q_rope = self.rope(q_rope, cos, sin)  # [L, H, rope]
            k_rope = self.rope(k_rope, cos, sin)  # [L, 1, rope]
        kv = k_rope.new_empty(n, 1, m.key_width)  # [L, 1, rank + rope]: the one KV head, as cached
        kv[..., :m.kv_lora_rank], kv[..., m.kv_lora_rank:] = c[:, None], k_rope
        if not self.sparse and getattr(attn, "mla_form", "absorbed") == "expanded":
            q_full = q_rope.new_empty(n, h, m.qk_head_dim)  # [L, H, nope + rope]: the ordinary query
            q_full[..., :m.qk_nope_head_dim], q_full[..., m.qk_nope_head_dim:] = q_nope, q_rope
            out = attn(self.layer_idx, q_full, kv, kv[..., :m.kv_lora_rank], expand=self.expand)  # [L, H, v]
            return self.o_proj(out.reshape(n, h * m.v_head_dim))
        w = self.kv_b_proj.weight.view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]  # [H, nope, rank], [H, v, rank]
        q_lat = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1)  # [L, H, rank]: W_UK folded into the query
        q_abs = q_rope.new_empty(n, h, m.key_width)  # [L, H, rank + rope]
        q_abs[..., :m.kv_lora_rank], q_abs[..., m.kv_lora_rank:] = q_lat, q_rope
        if self.sparse:  # DSA layers stay absorbed: each query reads its top-k latent rows (`indexer.py`)
            index = self.indexer(x, q_latent, cos, sin) if hasattr(self, "indexer") else None  # None: "shared"
            out_lat = attn(self.layer_idx, q_abs, kv, kv[..., :m.kv_lora_rank], index=index)  # [L, H, rank]
        else:
            out_lat = attn(self.layer_idx, q_abs, kv, kv[..., :m.kv_lora_rank])  # [L, H, rank]
        out = (out_lat.transpose(0, 1) @ w_uv.transpose(1, 2)).transpose(0, 1)  # [L, H, v]: W_UV after the merge
        return self.o_proj(out.reshape(n, h * m.v_head_dim))

    def expand(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Latent rows [N, 1, rank + rope] (as cached: c ⊕ k_r, RoPE applied) -> per-head keys k [N, H, nope + rope]
        (c W_UK,h ⊕ the shared k_r) and values v [N, H, v] (c W_UV,h): one GEMM with kv_b_proj's weight."""
        m, n, h = self.m, rows.shape[0], self.num_heads
        c, k_rope = rows[:, 0].split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)  # [N, rank], [N, rope]
        kv = (c @ self.kv_b_proj.weight.T).view(n, h, m.qk_nope_head_dim + m.v_head_dim)  # [N, H, nope + v]
        k = rows.new_empty(n, h, m.qk_head_dim)  # [N, H, nope + rope]
        k[..., :m.qk_nope_head_dim], k[..., m.qk_nope_head_dim:] = kv[..., :m.qk_nope_head_dim], k_rope[:, None]
        return k, kv[..., m.qk_nope_head_dim:]


__all__ = ["MLAttention"]
