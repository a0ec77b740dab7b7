"""Multi-head latent attention under CP (`cpinfer bench mla`): K/V bytes per token stored and sent per ring step, the
latent against the per-head layout of the same model, and CP-N vs CP-1 prefill TTFT of a DeepSeek-shaped model.

Bytes are measured on the real objects: the engine's KV store (`cache_stats()` after a prefill: device bytes per
cached token) and the message pass-KV's ring packs for one rank's tokens (`pass_kv._pack_kv` on a 2-rank plan),
once with MLA's latent (one KV head, the values inside the keys) and once with the per-head K/V the same layer would
expand to (H heads of qk_nope + qk_rope keys and v_head_dim values). TTFT: one full prefill per CP size on a fresh
`LLM`, one thread per rank, attention in the absorbed form.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from cpinfer.bench import common as C
from cpinfer.bench import prefill as P


def model_config(args, max_positions: int) -> dict:
    """config.json of a random DeepSeek-V3-shaped model: MLA over a dense MLP (the attention is what is measured)."""
    positions = 1 << max(12, (max_positions - 1).bit_length())
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                intermediate_size=args.ffn, vocab_size=args.vocab, max_position_embeddings=positions,
                kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim, qk_nope_head_dim=args.nope_dim,
                v_head_dim=args.v_dim, q_lora_rank=args.q_lora_rank, n_routed_experts=0, rope_theta=10000.0)


def message_bytes_per_token(cfg: dict, tokens: int) -> dict:
    """Bytes per token of pass-KV's ring message for one layer: `tokens` keys of one rank packed by `_pack_kv` on a
    2-rank plan, MLA (the latent, values inside the keys) and per-head (H x (nope + rope) keys, H x v values)."""
    from cpinfer.cp import pass_kv
    from cpinfer.cp.plan import plan_from_metadata
    from cpinfer.attention.step import HeadLayout

    h, r, dr, dn, dv = (cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
                        cfg["qk_nope_head_dim"], cfg["v_head_dim"])
    seq, pos = np.zeros(tokens, np.int64), np.arange(tokens, dtype=np.int64)
    q_meta = [(seq[:1], pos[-1:] + 1), (seq[:1], pos[-1:] + 2)]  # one query per rank sees every key
    out = {}
    for name, (hkv, dk, dval, in_keys) in {"mla": (1, r + dr, r, True), "per_head": (h, dn + dr, dv, False)}.items():
        plan = plan_from_metadata(q_meta, [(seq, pos), (seq[:0], pos[:0])], group=None, rank=0, world=2,
                                  strategy="pass-kv", values_in_keys=in_keys)
        k = torch.zeros(tokens, hkv, dk)
        v = k[..., :dval] if in_keys else torch.zeros(tokens, hkv, dval)
        plan.prepare(HeadLayout(h, hkv, dk, k.dtype), k.device).upload()
        out[name] = pass_kv._pack_kv(plan, k, v).nbytes / tokens
    return out


def stored_bytes_per_token(model_dir, tokens: int, vocab: int) -> float:
    """Device KV bytes per cached token (every layer) reported by the engine after a prefill of `tokens` (a small
    host tier on, so that `cache_stats()` counts bytes)."""
    from cpinfer import LLM, SamplingParams

    with LLM(str(model_dir), threads_per_rank=1, max_kv_tokens_per_rank=C.kv_capacity(tokens + 64),
             kv_host_gib=0.01) as llm:
        llm.generate(C.random_prompt(tokens, vocab, seed=7), SamplingParams(max_tokens=2, temperature=0.0,
                                                                            ignore_eos=True))
        dev = llm.cache_stats()["tiers"]["device"]
    return dev["bytes"] / dev["tokens"]


def per_head_stored(cfg: dict, elem: int) -> int:
    """Per-head layout of the same model: every layer H x ((nope + rope) key + v value) per token."""
    per_layer = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    return cfg["num_hidden_layers"] * per_layer * elem


def measure(args) -> dict:
    cfg = model_config(args, args.tokens + 1024)
    model_dir = C.random_model("bench-mla", **cfg)
    hw = C.hardware(args)
    elem = 2 if hw["dtype"] in ("bfloat16", "float16") else 4
    stored = stored_bytes_per_token(model_dir, 256, args.vocab)
    sent = message_bytes_per_token(cfg, 256)
    elem_scale = elem / 4  # the message probe packs fp32 tensors
    engine = {str(n): P.time_engine(model_dir, n, args.tokens, args.vocab, args.repeat, hw) for n in args.cp}
    base = min(args.cp)
    return {"bench": "mla", "command": command_line(args, hw), "tokens": args.tokens, "model": shape_text(cfg, hw),
            "bytes": {"stored": {"mla": stored, "per_head": per_head_stored(cfg, elem)},
                      "sent_per_layer": {k: v * elem_scale for k, v in sent.items()}},
            "repeat": args.repeat, "baseline_cp": base, "engine": engine,
            "ratio": {n: e["ttft_s"] / engine[str(base)]["ttft_s"] for n, e in engine.items()}}


def shape_text(cfg: dict, hw: dict) -> str:
    return (f"DeepSeek-V3-shaped: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            f"{cfg['num_attention_heads']} heads, kv_lora_rank {cfg['kv_lora_rank']} + qk_rope "
            f"{cfg['qk_rope_head_dim']}, qk_nope {cfg['qk_nope_head_dim']}, v {cfg['v_head_dim']}, q_lora_rank {cfg['q_lora_rank']}, dense "
            f"ffn {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, {C.hardware_text(hw)}")


def format_report(res: dict) -> str:
    b = res["bytes"]
    rows = [[what, f"{b[key]['mla']:.0f}", f"{b[key]['per_head']:.0f}", f"{b[key]['per_head'] / b[key]['mla']:.1f}x"]
            for what, key in (("stored in the KV cache (every layer)", "stored"),
                              ("sent per ring step (pass-KV message, one layer)", "sent_per_layer"))]
    out = [f"K/V bytes per token, {res['model']}:", "",
           C.fmt_table(["", "MLA latent", "per-head K/V", "per-head / MLA"], rows), "",
           f"Full prefill of {res['tokens']} tokens, TTFT, 1 thread per rank, median of {res['repeat']}:", ""]
    base = res["baseline_cp"]
    out.append(C.fmt_table(["CP", "strategy", "TTFT (s)", f"TTFT / TTFT(CP{base})"],
                           [[n, e["strategy"], f"{e['ttft_s']:.2f}", f"{res['ratio'][n]:.3f}"]
                            for n, e in res["engine"].items()]))
    return "\n".join(out)


def command_line(args, hw: dict) -> str:
    cmd = f"cpinfer bench mla --cp {','.join(map(str, args.cp))} --tokens {args.tokens} --repeat {args.repeat}"
    for name, default in DEFAULTS.items():
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd + C.hardware_flags(hw)


DEFAULTS = dict(hidden=1024, layers=2, heads=8, ffn=2816, vocab=4096, kv_lora_rank=512, rope_dim=64, nope_dim=128,
                v_dim=128, q_lora_rank=384)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--tokens", type=C.positive_int, default=16384, help="prompt length (default: 16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=1, help="timed prefills after a warm-up (default: 1)")
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=C.positive_int, default=default,
                            help=f"{name} (default: {default})")
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, f"mla-{args.tokens}",
                          lambda res: f"MLA: latent vs per-head K/V bytes, prefill {args.tokens} tokens, CP "
                                      f"{', '.join(res['engine'])}")
