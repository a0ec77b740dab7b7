"""What `serve` and `generate` share on the command line: the model as vLLM names it (a positional MODEL or --model;
a folder, a .gguf file or a Hugging Face Hub id, with --revision, --download-dir, --tokenizer, --generation-config)
and a help formatter that prints each default once.
"""
from __future__ import annotations

import argparse
import os

from cpinfer.model.resolve import GENERATION_CONFIGS


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already speaks of its default or there is none to
    show (None, False, a suppressed default, a switch that takes no value)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction) or not action.option_strings
                or (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        return f"{text} (default: %(default)s)"


def add_model_arguments(parser: argparse.ArgumentParser, default_help: str) -> None:
    """MODEL (positional, as vLLM) / --model, and how a Hub id is fetched."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (vLLM's positional form)")
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="MODEL", help=default_help)
    g.add_argument("--tokenizer", default=None, metavar="T",
                   help="a tokenizer folder or Hub id other than the model's (default: the model's own)")
    g.add_argument("--revision", default=None, metavar="R",
                   help="Hub revision of a model given by id: a branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default=None, metavar="D",
                   help="Hugging Face cache folder to download into and read from (default: huggingface_hub's, "
                        "$HF_HUB_CACHE or ~/.cache/huggingface/hub). HF_TOKEN authenticates gated or private "
                        "repositories; HF_HUB_OFFLINE=1 uses the cache alone")
    g.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="sampling defaults for requests that set none: auto = the model's generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps a chat's default "
                        "max_tokens), vllm = none (temperature 1), or a "
                        "folder holding a generation_config.json (default: auto)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that give no seed, so a run repeats (default: 0)")


def model_name(args) -> str | None:
    """The model the user named (positional MODEL or --model; None: the embedded default). Both given and different
    is an error."""
    tag, flag = getattr(args, "model_tag", None), args.model
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"the model is given twice, as MODEL {tag!r} and --model {flag!r}: give one")
    return tag if tag is not None else flag


def resolve_args(args):
    """(model folder, tokenizer folder or None) for the command line; ValueError before any rank starts."""
    from cpinfer.model.resolve import generation_defaults, resolve_model, resolve_tokenizer

    choice = args.generation_config
    if choice not in GENERATION_CONFIGS and not os.path.isdir(os.path.expanduser(choice)):
        raise ValueError(f"--generation-config {choice!r}: expected auto, vllm or a folder holding a "
                         "generation_config.json")
    model = resolve_model(model_name(args), revision=args.revision, download_dir=args.download_dir)
    generation_defaults(model, choice)  # a broken generation_config.json fails here
    tokenizer = None if args.tokenizer is None else resolve_tokenizer(args.tokenizer, download_dir=args.download_dir)
    return model, tokenizer


def engine_model_kwargs(args, tokenizer) -> dict:
    """The engine's keyword arguments for the model's source: tokenizer, sampling defaults, seed."""
    out = {"generation_config": args.generation_config, "seed": args.seed}
    if tokenizer is not None:
        out["tokenizer"] = str(tokenizer)
    return out


def add_pd_arguments(g) -> None:
    """--pd-decode-cp / --pd-decode-groups: prefill on the --cp ranks, decode on separate groups (docs/engine.md)."""
    from cpinfer.bench.attention import positive_int

    g.add_argument("--pd-decode-cp", type=positive_int, default=None, metavar="M",
                   help="run prefill and decode on separate ranks: prefill on the --cp ranks, decode on groups of M "
                        "CP ranks (x --tp each); K/V move between them once per request")
    g.add_argument("--pd-decode-groups", type=positive_int, default=None, metavar="K",
                   help="decode groups of --pd-decode-cp ranks (default 1); a request goes to the least loaded")


def _speculative_json(text: str):
    """--speculative-config: vLLM's JSON, checked now (a bad key or method is an argument error)."""
    from cpinfer.engine.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_speculative_argument(parser) -> None:
    """--speculative-config JSON (serve and generate)."""
    parser.add_argument("--speculative-config", type=_speculative_json, default=None, metavar="JSON",
                        help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                             "4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (prompt lookup) or "
                             "'{\"model\": PATH, \"num_speculative_tokens\": 4}' (a draft model); default: off")
