"""Multi-head latent attention under CP (`cpinfer bench mla`): K/V bytes per token stored and sent per ring step, the
latent against the per-head layout of the same model, and CP-N vs CP-1 prefill TTFT of a DeepSeek-shaped model.

Bytes are measured on the real objects: the engine's KV store (`cache_stats()` after a prefill: device bytes per
cached token) and the message pass-KV's ring packs for one rank's tokens (`pass_kv._pack_kv` on a 2-rank plan),
once with MLA's latent (one KV head, the values inside the keys) and once with the per-head K/V the same layer would
expand to (H heads of qk_nope + qk_rope keys and v_head_dim values).

Prefill in both attention forms (`engine/mla_form.py`): per prompt length and CP size, one full prefill on a fresh
`LLM` with `mla_form="absorbed"` and one with `"expanded"` (one thread per rank; the ring carries the latent either
way), their TTFT, and the attention FLOPs of each form by the formula the engine chooses with (every layer, every
rank: pass-KV up-projects each ring block on every rank).
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
                                                                            ignore_eos=True), use_tqdm=False)
        dev = llm.cache_stats()["tiers"]["device"]
    return dev["bytes"] / dev["tokens"]


def per_head_stored(cfg: dict, elem: int) -> int:
    """Per-head layout of the same model: every layer H x ((nope + rope) key + v value) per token."""
    per_layer = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    return cfg["num_hidden_layers"] * per_layer * elem


FORMS = ("absorbed", "expanded")


def prefill_flops(cfg: dict, tokens: int, cp: int) -> dict:
    """Attention FLOPs of a full prefill of `tokens` in each form (every layer, every rank), and the form the
    engine's rule picks: `mla_form.attention_flops` on the causal pairs, pass-KV's rows up-projected on every rank."""
    from cpinfer.engine.mla_form import attention_flops, choose_form
    from cpinfer.model.config_parts import MLAConfig

    mla = MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"])
    seqs = [(0, tokens, cp > 1)]
    choice = choose_form(mla, cfg["num_attention_heads"], seqs, cp, "pass-kv" if cp > 1 else "local")
    return {**{f: v * cfg["num_hidden_layers"] for f, v in choice.flops.items()}, "auto": choice.form}


def time_forms(model_dir, cfg: dict, args, hw: dict) -> dict:
    """{"<tokens>/<cp>": {"flops": ..., "<form>": time_engine's result}} for every prompt length and CP size."""
    out = {}
    for tokens in args.tokens:
        for n in args.cp:
            row = {"tokens": tokens, "cp": n, "flops": prefill_flops(cfg, tokens, n)}
            for form in FORMS:
                row[form] = P.time_engine(model_dir, n, tokens, args.vocab, args.repeat, {**hw, "mla_form": form})
            row["speedup"] = row["absorbed"]["ttft_s"] / row["expanded"]["ttft_s"]
            out[f"{tokens}/{n}"] = row
    return out


def measure(args) -> dict:
    cfg = model_config(args, max(args.tokens) + 1024)
    model_dir = C.random_model("bench-mla", **cfg)
    hw = C.hardware(args)
    elem = 2 if hw["dtype"] in ("bfloat16", "float16") else 4
    stored = stored_bytes_per_token(model_dir, 256, args.vocab)
    sent = message_bytes_per_token(cfg, 256)
    elem_scale = elem / 4  # the message probe packs fp32 tensors
    return {"bench": "mla", "command": command_line(args, hw), "tokens": args.tokens, "model": shape_text(cfg, hw),
            "bytes": {"stored": {"mla": stored, "per_head": per_head_stored(cfg, elem)},
                      "sent_per_layer": {k: v * elem_scale for k, v in sent.items()}},
            "repeat": args.repeat, "forms": time_forms(model_dir, cfg, args, hw)}


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
           f"Full prefill, absorbed vs expanded attention, TTFT with 1 thread per rank (median of {res['repeat']}); "
           "attention TFLOPs by formula over every layer and rank (`engine/mla_form.py`):", ""]
    rows = [[r["tokens"], r["cp"], r["absorbed"]["strategy"], f"{r['flops']['absorbed'] / 1e12:.3g}",
             f"{r['flops']['expanded'] / 1e12:.3g}", f"{r['flops']['absorbed'] / r['flops']['expanded']:.1f}x",
             f"{r['absorbed']['ttft_s']:.2f}", f"{r['expanded']['ttft_s']:.2f}", f"{r['speedup']:.2f}x",
             r["flops"]["auto"]] for r in res["forms"].values()]
    out.append(C.fmt_table(["tokens", "CP", "strategy", "absorbed TFLOP", "expanded TFLOP", "FLOP ratio",
                            "absorbed TTFT (s)", "expanded TTFT (s)", "speed-up", "auto picks"], rows))
    return "\n".join(out)


def command_line(args, hw: dict) -> str:
    cmd = (f"cpinfer bench mla --cp {','.join(map(str, args.cp))} --tokens {','.join(map(str, args.tokens))} "
           f"--repeat {args.repeat}")
    for name, default in DEFAULTS.items():
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd + C.hardware_flags(hw)


DEFAULTS = dict(hidden=1024, layers=2, heads=16, ffn=2816, vocab=4096, kv_lora_rank=512, rope_dim=64, nope_dim=128,
                v_dim=128, q_lora_rank=384)


def _lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of prompt lengths (e.g. 8192,16384), "
                                         f"got {text!r}")
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--tokens", type=_lengths, default=[8192, 16384], metavar="N,N",
                        help="prompt lengths (default: 8192,16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=1, help="timed prefills after a warm-up (default: 1)")
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=C.positive_int, default=default,
                            help=f"{name} (default: {default})")
    C.add_common_arguments(parser)


def run(args) -> int:
    lengths = "-".join(map(str, args.tokens))
    return C.run_measured(args, measure, format_report, f"mla-{lengths}",
                          lambda res: f"MLA: latent vs per-head K/V bytes, absorbed vs expanded prefill of "
                                      f"{', '.join(map(str, args.tokens))} tokens, CP {', '.join(map(str, args.cp))}")
