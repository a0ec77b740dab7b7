"""FP8 KV cache: K and V stored as e4m3 bytes, in one of two formats (`kv_cache_dtype`, vLLM's names plus one):

- `"fp8"` (= `"fp8_e4m3"`): one static scale per layer and KV head, for K and for V — the checkpoint's
  `self_attn.k_scale` / `v_scale` when it has them, else calibrated at load (`calibrate_kv_scales`: one forward
  over a fixed input, each head's |K| / |V| maximum x 8 headroom / 448, rounded up to a power of two). A row is its
  D e4m3 bytes and nothing else: exactly half of bf16, a quarter of fp32. Values beyond 448 x scale saturate, and
  values below 2^-6 x scale lose relative precision (e4m3 subnormals). (vLLM's default scale, 1.0, puts small
  values among the subnormals: on the embedded SmolLM2 it loses a pass key that calibrated scales keep.)
- `"fp8_per_token"`: every row (one token, one KV head) has its own fp32 scale, amax / 448, packed after its
  values: [D + 4] bytes, (D + 4) / 2D of bf16 (0.52 at D = 128). It never saturates and keeps every row's relative
  precision, at 4 bytes per row.

MLA (one latent head [c ; k_r] per token, the values its first kv_lora_rank channels) takes the static format
only: the row is kv_lora_rank + qk_rope_head_dim e4m3 bytes, the latent c by one scale per layer and the rotary
key k_r by another (a per-channel scale [1, W], `mla_scales`), so the values stay a view of the keys' first bytes.

Both formats quantize a row the same whatever the sharding: a static scale is fixed before any token is seen (the
calibration input is the same on every rank, and a power of two does not move with the last bits of a sum), a
per-token scale depends on its row alone — so a tier entry written at one CP size restores at another. What they
quantize is not bitwise the same across CP sizes: K/V of later layers carry fp32 noise from attention merged in
another order, and an element near an e4m3 rounding boundary rounds the other way; such steps cascade through the
layers, so CP N agrees with CP 1 within the FP8 cache's own error, not exactly (docs/quantization.md has the
measured figures). (A scale calibrated on a first prefill would also depend on which tokens each rank saw.)

The store, the pass-KV ring messages and the tier entries carry the stored rows; the attention step dequantizes them
(`RowCodec.decode`) to the compute dtype, new tokens included, so every query sees the same K/V whichever step
reads it. Nothing here knows the row width: keys and values may differ in width.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from torch import Tensor

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_per_token")  # vLLM's names ("fp8" means e4m3) + per token
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # one fp32 scale per row (per-token format)
_CANONICAL = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_per_token": "fp8_per_token"}


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name ("auto", "fp8" or "fp8_per_token"); anything else is a ValueError naming the allowed
    values."""
    if name not in _CANONICAL:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _CANONICAL[name]


def is_fp8(kv_cache_dtype: str) -> bool:
    return check_kv_cache_dtype(kv_cache_dtype) != "auto"


def per_token(kv_cache_dtype: str) -> bool:
    return check_kv_cache_dtype(kv_cache_dtype) == "fp8_per_token"


def row_bytes(width: int, elem_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one stored K or V row of `width` values: width x element size; width in FP8 (+ 4 per token)."""
    if not is_fp8(kv_cache_dtype):
        return width * elem_bytes
    return width + SCALE_BYTES if per_token(kv_cache_dtype) else width


def layout_dtype(dtype: str, kv_cache_dtype: str) -> str:
    """The dtype a KV-tier entry is keyed by: the compute dtype, or the FP8 row format (so an FP8 entry is never
    read back as full precision, nor in the other FP8 format). Static scales come with the checkpoint, which the
    entry's key names already."""
    kvd = check_kv_cache_dtype(kv_cache_dtype)
    if kvd == "auto":
        return dtype
    return "fp8_e4m3+scale_f32_per_token_head" if kvd == "fp8_per_token" else "fp8_e4m3+static_scale_per_layer_head"


def encode(x: Tensor) -> Tensor:
    """Per-token format: x [..., W] (any float dtype) -> packed uint8 [..., W + 4]: e4m3(x / s) then
    s = amax(|x|) / 448 as fp32 bytes; an all-zero row gets s = 0 (and decodes to zeros)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # [..., 1]
    q = (xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)  # [..., W + 4]


_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # byte -> its e4m3 value in fp32


def e4m3_to_float(b: Tensor) -> Tensor:
    """uint8 [...] holding e4m3 bytes -> fp32 [...] of their values (a new tensor). On CPU a 256-entry table lookup,
    about twice as fast as torch's element-wise conversion and the same values (NaN codes included)."""
    if b.device.type != "cpu":
        return b.view(FP8).float()
    return torch.index_select(_E4M3_TABLE, 0, b.reshape(-1).int()).view(b.shape)


def decode(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-token format: packed uint8 [..., W + 4] -> [..., W] in `dtype` (e4m3 value x scale in fp32)."""
    w = p.shape[-1] - SCALE_BYTES
    scale = p[..., w:].contiguous().view(torch.float32)  # [..., 1]
    return e4m3_to_float(p[..., :w]).mul_(scale).to(dtype)


def _per_channel(scale: Tensor) -> Tensor:
    """A static scale [Hkv] (one per head) or [Hkv, W] (one per channel: MLA) as a [Hkv, 1 or W] multiplier."""
    return scale[:, None] if scale.dim() == 1 else scale


def encode_static(x: Tensor, scale: Tensor) -> Tensor:
    """Static format: x [..., Hkv, W] with scale [Hkv] (or [Hkv, W]) fp32 -> uint8 [..., Hkv, W], e4m3(x / scale)
    saturated at +-448."""
    q = (x.float() / _per_channel(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(torch.uint8)


def decode_static(p: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Static format: uint8 [..., Hkv, W] -> [..., Hkv, W] in `dtype` (e4m3 value x its head's (channel's) scale in
    fp32)."""
    return e4m3_to_float(p).mul_(_per_channel(scale)).to(dtype)


def mla_scales(latent: Tensor, rope: Tensor, rank: int, rope_dim: int) -> tuple[Tensor, Tensor]:
    """MLA's static scales per channel from one scale per layer for the latent c and one for the rotary key k_r
    (latent, rope [layers]) -> (k [layers, 1, rank + rope_dim], v [layers, 1, rank]); v's are k's first channels, so
    decoding the values (the keys' first bytes) gives the keys' first channels exactly."""
    k = torch.cat((latent[:, None].expand(-1, rank), rope[:, None].expand(-1, rope_dim)), dim=1)[:, None]
    return k.float().contiguous(), k[..., :rank].float().contiguous()


@dataclasses.dataclass(frozen=True)
class RowCodec:
    """How one layer's K (or V) rows are stored in FP8: `scale` [Hkv] (or [Hkv, W] per channel: MLA) fp32 (static
    format) or None (per token)."""

    scale: Tensor | None = None

    def encode(self, x: Tensor) -> Tensor:  # [..., Hkv, W] -> uint8 [..., Hkv, W (+ 4)]
        return encode(x) if self.scale is None else encode_static(x, self.scale)

    def decode(self, p: Tensor, dtype: torch.dtype) -> Tensor:  # uint8 [..., Hkv, W (+ 4)] -> [..., Hkv, W]
        return decode(p, dtype) if self.scale is None else decode_static(p, self.scale, dtype)


def encode_rows(codecs: tuple[RowCodec, RowCodec], k: Tensor, v: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
    """A layer's new K / V rows -> uint8 rows by its (K, V) codecs. `shared` (MLA): the value is the latent's first
    channels, so v is the view of the encoded k's first bytes, never encoded on its own."""
    kq = codecs[0].encode(k)
    return kq, kq[..., :v.shape[-1]] if shared else codecs[1].encode(v)


def decode_rows(codecs: tuple[RowCodec, RowCodec], k: Tensor, v: Tensor, dtype: torch.dtype,
                shared: bool) -> tuple[Tensor, Tensor]:
    """uint8 K / V rows -> `dtype` by the layer's (K, V) codecs; `shared` (MLA): v is the decoded k's first
    channels (the stored v is that view, `v.shape[-1]` wide)."""
    kd = codecs[0].decode(k.contiguous(), dtype)
    return kd, kd[..., :v.shape[-1]] if shared else codecs[1].decode(v.contiguous(), dtype)


def layer_codecs(kv_cache_dtype: str, scales: tuple[Tensor, Tensor] | None, num_layers: int, n_kv_heads: int,
                 device) -> list[tuple[RowCodec, RowCodec]] | None:
    """Per layer (K codec, V codec); None without an FP8 cache. `scales`: (k [layers, Hkv], v [layers, Hkv]) static
    scales, or per channel (k [layers, Hkv, Wk], v [layers, Hkv, Wv]: MLA's, `mla_scales`) (default all 1.0);
    ignored in the per-token format."""
    kvd = check_kv_cache_dtype(kv_cache_dtype)
    if kvd == "auto":
        return None
    if kvd == "fp8_per_token":
        return [(RowCodec(), RowCodec())] * num_layers
    if scales is None:
        scales = (torch.ones(num_layers, n_kv_heads), torch.ones(num_layers, n_kv_heads))
    k, v = (s.to(device=device, dtype=torch.float32) for s in scales)
    if k.shape[:2] != (num_layers, n_kv_heads) or v.shape[:2] != (num_layers, n_kv_heads) or k.dim() != v.dim():
        raise ValueError(f"static KV scales must be [{num_layers}, {n_kv_heads}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    return [(RowCodec(k[i]), RowCodec(v[i])) for i in range(num_layers)]


_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def checkpoint_kv_scales(model_path: str | Path, num_layers: int, n_kv_heads: int, head_slice: slice | None = None,
                         layers=None) -> tuple[Tensor, Tensor] | None:
    """The static KV scales a safetensors checkpoint carries (`model.layers.N.self_attn.k_scale` / `v_scale`: one
    per layer, or one per KV head), as (k [layers, Hkv], v [layers, Hkv]) fp32 for this rank's KV heads
    (`head_slice` under TP); None when it carries none (then every scale is 1.0). `layers`: the model layers that
    hold K/V, in the KV cache's order (default all `num_layers`; a hybrid's attention layers). A checkpoint with
    some scales missing, non-positive, or of another shape is a ValueError naming the tensor."""
    from safetensors import safe_open

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    found: dict[tuple[int, str], Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _SCALE_NAME.match(name)
                if m and int(m.group(1)) < num_layers:
                    found[(int(m.group(1)), m.group(2))] = f.get_tensor(name).float().reshape(-1)
    if not found:
        return None
    layers = list(range(num_layers) if layers is None else layers)
    out = {"k": torch.ones(len(layers), n_kv_heads), "v": torch.ones(len(layers), n_kv_heads)}
    for row, layer in enumerate(layers):
        for kind in ("k", "v"):
            name = f"model.layers.{layer}.self_attn.{kind}_scale"
            if (layer, kind) not in found:
                raise ValueError(f"the checkpoint has static KV scales for some layers but not {name}")
            s = found[(layer, kind)]
            if s.numel() != 1 and head_slice is not None:
                s = s[head_slice]
            if s.numel() not in (1, n_kv_heads):
                raise ValueError(f"{name} has {s.numel()} values; expected 1 or one per KV head ({n_kv_heads})")
            if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
                raise ValueError(f"{name} must be positive and finite, got {s.tolist()}")
            out[kind][row] = s
    return out["k"], out["v"]



CALIBRATION_TOKENS = 256
HEADROOM = 8.0  # the calibration maximum x 8 maps to 448: three binades of room above what the fixed input reached


@torch.inference_mode()
def calibrate_kv_scales(model, config, device) -> tuple[Tensor, Tensor]:
    """Static scales when the checkpoint has none: the model run once over a fixed input — the BOS token (where
    the config names one), then `CALIBRATION_TOKENS - 1` ids drawn from a seeded generator — with dense causal
    attention; per layer and KV head (this TP rank's heads: the model's own), amax(|K|) and amax(|V|) x HEADROOM /
    448, rounded up to a power of two → (k [layers, Hkv], v [layers, Hkv]) fp32 on the CPU; MLA: one scale for the
    latent and one for the rotary key per layer, as per-channel scales (`mla_scales`). A hybrid model: its attention
    layers' scales, in the KV cache's order (the recurrent layers run from a zero state). Under TP every rank of the
    group must call it together (the model's all-reduces)."""
    from cpinfer.model import ReferenceAttention

    n = min(CALIBRATION_TOKENS, int(getattr(config, "max_position_embeddings", 0) or CALIBRATION_TOKENS))
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, int) and 0 <= bos < config.vocab_size:
        ids[0] = bos
    ids, pos = ids.to(device), torch.arange(n, device=device)
    ref = ReferenceAttention(torch.zeros(n, dtype=torch.long, device=device), pos, config=config)
    amax: dict[int, tuple[Tensor, Tensor]] = {}

    mla = bool(getattr(config, "values_in_keys", False))

    def attn(layer, q, k, v, sinks=None, index=None):  # k / v [n, Hkv, D] (MLA: k [n, 1, rank + rope], v its first
        # channels); index: a DSA layer's indexer rows, unused (dense attention calibrates its latent as well)
        keys = k[..., v.shape[-1]:] if mla else k  # MLA: the rotary key part; the latent is v
        amax[layer] = (keys.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2)))
        return ref(layer, q, k, v, sinks=sinks)

    recurrent = None
    if getattr(config, "hybrid", False):
        from cpinfer.model.recurrent.reference import ReferenceRecurrence

        recurrent = ReferenceRecurrence()
        recurrent.set_batch([0] * n)
    model(ids, pos, attn, recurrent)
    layers = sorted(amax)
    expected = list(getattr(config, "attention_layers", range(len(layers))))
    if layers != expected:
        raise RuntimeError(f"calibration saw layers {layers}, expected {expected}")

    def scale(a: Tensor) -> Tensor:
        a = torch.where(torch.isfinite(a) & (a > 0), a, torch.ones_like(a))
        return torch.exp2(torch.ceil(torch.log2(a * HEADROOM / FP8_MAX))).cpu()

    k, v = torch.stack([scale(amax[i][0]) for i in layers]), torch.stack([scale(amax[i][1]) for i in layers])
    if mla:  # per channel: the latent's scale on its channels, the rotary key's on the rest
        return mla_scales(v[:, 0], k[:, 0], config.kv_value_width, config.kv_key_width - config.kv_value_width)
    return k, v
