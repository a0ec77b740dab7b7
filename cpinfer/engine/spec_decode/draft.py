"""The driver side of a draft model: checks it against the target before any rank starts, and proposes drafts by
running the draft's k steps on the ranks (`draft_runner.propose`) for the requests that speculate.

The draft's K/V need no bookkeeping here: its store on every rank uses the target's slots (`draft_runner`), so
the target's KV manager (placement, prefix caching, preemption, rollback) serves both.
"""
from __future__ import annotations

import math

from pathlib import Path

import numpy as np

from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.request import Request
from cpinfer.engine.spec_decode import draft_runner as DR
from cpinfer.engine.spec_decode.proposer import Proposer
from cpinfer.model.config import ModelConfig
from cpinfer.model.resolve import resolve_model


def check_draft(target: ModelConfig, tokenizer, draft_path: str | Path, tensor_parallel_size: int) -> ModelConfig:
    """The draft's config, or ValueError saying why this draft cannot serve this target: another vocabulary size
    or tokenizer vocabulary, tensor parallelism, or an attention form the draft path does not run."""
    draft = ModelConfig.from_pretrained(draft_path)
    if tensor_parallel_size != 1:
        raise ValueError(f"a draft model runs with tensor_parallel_size 1 only, got {tensor_parallel_size} (use "
                         "\"method\": \"ngram\" under tensor parallelism)")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}: a draft model must share the target's tokenizer")
    theirs = _tokenizer_vocab(draft_path)
    if theirs is not None and tokenizer is not None:
        ours = tokenizer.get_vocab()
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise ValueError(f"the draft model's tokenizer differs from the target's ({len(theirs)} vs {len(ours)} "
                             f"entries; e.g. {differ}): a draft model must share the target's tokenizer")
    if draft.dsa is not None:
        raise ValueError(f"a draft model with DeepSeek sparse attention ({draft.model_type}) is not supported: the "
                         "draft path keeps no indexer keys and runs no top-k; use a draft with ordinary attention "
                         "(a DSA target takes any such draft)")
    if draft.values_in_keys:
        raise ValueError(f"a draft model with multi-head latent attention ({draft.model_type}) is not supported; "
                         "use a draft with ordinary attention")
    if draft.hybrid:
        raise ValueError(f"a hybrid (linear-attention) draft model ({draft.model_type}) is not supported: the draft "
                         "keeps no recurrent state; use a draft with attention on every layer")
    if draft.local_attention:
        raise ValueError(f"a draft model with sliding-window or chunked attention ({draft.model_type}) is not "
                         "supported; use a draft with full attention on every layer")
    return draft


def resolve_draft(model, target: ModelConfig, tokenizer, tensor_parallel_size: int, revision: str | None = None,
                  download_dir: str | None = None) -> tuple[str, ModelConfig]:
    """The draft's checkpoint folder (a folder, a .gguf file converted as the target's, or a Hub id) and config,
    checked against the target (`check_draft`): what the engine does before any rank starts."""
    path = str(resolve_model(model, revision=revision, download_dir=download_dir))
    return path, check_draft(target, tokenizer, path, tensor_parallel_size)


def _tokenizer_vocab(path: str | Path) -> dict | None:
    """The token → id map of the tokenizer in `path`, or None when the folder has none."""
    p = Path(path)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p)).get_vocab()


def verify_rank(manager, kv) -> int:
    """The CP rank the KV manager will put a request's verification rows on when it has room there
    (`KVManager.verify_rank`). Should the manager place them elsewhere, that rank holds no q: it accepts no draft of a
    sampled request (exact, as plain sampling)."""
    return manager.verify_rank(kv)


def draft_for(args, target: ModelConfig, tokenizer) -> tuple[str, ModelConfig] | None:
    """The engine's draft model (checkpoint folder, config), checked against the target; None without one."""
    spec = args.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return resolve_draft(spec.model, target, tokenizer, args.tensor_parallel_size, args.revision, args.download_dir)


def draft_token_bytes(draft: tuple[str, ModelConfig] | None, elem_bytes: int) -> int:
    """One token's bytes in the draft's KV store on a rank (0 without a draft): it holds the target's slot count."""
    if draft is None:
        return 0
    c = draft[1]
    return KVStore.bytes_per_token(c.num_hidden_layers, c.cached_kv_heads, KVWidths.of(c), elem_bytes)


def draft_weight_bytes(draft: tuple[str, ModelConfig] | None, elem_bytes: int) -> int:
    """The draft's weights on one rank (the whole model: drafts run without TP) in the engine's dtype, counted from
    its safetensors headers (no tensor is read); 0 without a draft."""
    if draft is None:
        return 0
    from safetensors import safe_open

    count = 0
    for f in sorted(Path(draft[0]).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                count += math.prod(h.get_slice(name).get_shape())
    return count * elem_bytes


def draft_reserve_bytes(engine_args, draft: tuple[str, ModelConfig] | None, elem_bytes: int) -> int:
    """What a draft loads on a rank after the KV cache is sized from GPU memory: its weights and its scratch rows
    (every running request's k draft steps); its store's per-slot bytes are `draft_token_bytes`."""
    if draft is None:
        return 0
    scratch = engine_args.max_num_seqs * engine_args.speculative_config.num_speculative_tokens
    return draft_weight_bytes(draft, elem_bytes) + (scratch + 1) * draft_token_bytes(draft, elem_bytes)


def load_draft(engine) -> None:
    """Load the engine's draft model on every rank beside the target (before any forward: the draft's K/V mirror
    the target's from the first one); scratch rows for every running request's k draft steps."""
    path = engine.draft[0]
    scratch = engine.args.max_num_seqs * engine.args.speculative_config.num_speculative_tokens
    engine._pool.run(DR.init_draft, path, scratch)


class DraftProposer(Proposer):
    """Drafts k tokens per request with the draft model on the ranks (`draft_runner.propose`): every CP rank runs
    the k steps together, the rank that will verify a request draws its tokens and keeps their q rows."""

    def propose(self, reqs: list[Request], ks: list[int]) -> list[np.ndarray]:
        """[k_i] int64 drafted tokens per request (k 0: none); the drafts' K/V stay in the draft's scratch rows
        until the verification's forward writes their slots."""
        eng = self.engine
        seqs = []
        for req, k in zip(reqs, ks):
            if k <= 0:
                continue
            kv = req.kv
            if kv.num_stored != len(req.prompt) + len(req.out) - 1:
                raise RuntimeError(f"draft proposal for {req.request_id}: {kv.num_stored} tokens stored of "
                                   f"{len(req.prompt) + len(req.out)} known (only the last may be missing)")
            rank = verify_rank(eng.kv, kv)
            if not eng.kv.room_for(rank, k + 1, kv):  # its verification would go elsewhere: no drafts
                continue
            seqs.append(DR.DraftSeq(req.request_id, int(req.out[-1] if req.out else req.prompt[-1]), kv.num_stored,
                                    rank, tuple(kv.runs_array(r) for r in range(eng.n)), int(k),
                                    eng._sample_spec(req)))
        drafted: dict[str, np.ndarray] = {}
        if seqs:
            for part in eng._pool.run(DR.propose, tuple(seqs)):
                drafted.update(part or {})
        empty = np.zeros(0, dtype=np.int64)
        return [drafted.get(req.request_id, empty) if k > 0 else empty for req, k in zip(reqs, ks)]
