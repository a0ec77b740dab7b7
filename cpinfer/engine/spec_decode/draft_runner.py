"""The rank side of a draft model: a second, smaller model on every CP rank whose K/V mirror the target's.

The draft keeps its own `KVStore` of the target's capacity, indexed by the same slots the driver's KV manager hands
out, so one placement serves both caches: every forward the target runs (prefill chunks, decodes, verifications)
runs through the draft too (`mirror`), and the draft's K/V always cover exactly the target's. Proposing runs k
draft-only decode steps per request through the same `BatchAttention` machinery as the target (the ring, pass-Q,
for a request whose K/V spread over ranks); their K/V go to scratch rows past the store's capacity (never a slot
the driver owns), and the verification's mirror writes the drafted tokens' real slots. Sampled requests keep each
step's processed draft distribution q on the rank that drafted them (`DraftRunner.q`), keyed by request id, for
the acceptance rule there.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpinfer.attention.step import HeadLayout
from cpinfer.engine.attention import BatchAttention, SlotPositions
from cpinfer.engine.batch import ForwardBatch, SeqInput
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.sampling import GREEDY_EPS, SampleSpec, scores_of, target_probs
from cpinfer.model import load_model

_DRAFT_SALT = 0x5DEECE66D  # draws of drafted tokens use their own stream, apart from the target's draws


@dataclasses.dataclass(frozen=True)
class DraftSeq:
    """One request's proposal: k tokens drafted after `token`, the last known token (not yet in the KV) at
    position `start`. The k draft rows go to `rank` (the CP rank that will verify, where q is kept)."""

    key: str  # the request id (`SeqInput.draft_key`)
    token: int
    start: int
    rank: int
    ctx_runs: tuple[np.ndarray, ...]  # per CP rank: [R, 2] slot runs of every key before `start` on its path
    k: int
    sample: SampleSpec  # the request's sampling of output token `sample.step` (greedy: argmax drafts)


@dataclasses.dataclass(frozen=True)
class DraftResult:
    """What a rank drafted: request id → [k] int64 tokens (only the rank that drafted a request lists it)."""

    tokens: dict[str, np.ndarray]
    forward_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Proposed:
    """Where a proposal's k draft rows are: scratch rows row0 .. row0+k-1 of `rank`, positions start ..."""

    rank: int
    row0: int
    k: int
    start: int


def draft_probs(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """logits [V] → the distribution a sampled request draws from, [V] fp32: the request's processing (bias, masks,
    penalties), then temperature, min-p, top-k and top-p, exactly as the target's draw and acceptance read it."""
    return target_probs(scores_of(logits, spec)[1], spec)


def _step_spec(spec: SampleSpec, drafted: list[int]) -> SampleSpec:
    """The spec of the draft step after `drafted` tokens: the step index advanced, the drafts counted in the output
    the penalties read; a grammar mask only holds for the first step (later drafts may break it: verification
    rejects them)."""
    if not drafted:
        return spec
    output = None if spec.output is None else np.concatenate((spec.output, np.asarray(drafted, dtype=np.int64)))
    return dataclasses.replace(spec, step=spec.step + len(drafted), output=output, allowed=None, suppress=())


class DraftRunner:
    """A draft model and its KV store on one CP rank (TP 1), beside the target's `ModelRunner`."""

    def __init__(self, ctx, target, draft_path: str, scratch: int):
        """target: this rank's `ModelRunner` (its store's capacity, groups, backend). scratch: rows past the
        store's capacity for draft-only steps (at least the most requests proposing at once times their k)."""
        self.ctx, self.target = ctx, target
        self.groups = target.groups
        self.config, self.model = load_model(draft_path, dtype=target.dtype, device=ctx.device)
        attn = self.model.model.layers[0].self_attn
        self.n_kv = attn.num_kv_heads
        self.widths = KVWidths.of(self.config)
        self.layout = HeadLayout(attn.num_heads, self.n_kv, self.widths.key, target.dtype)
        self.scale = self.config.attention_scale
        self.windows, self.chunks = self.config.windows, self.config.chunks
        capacity = target.store.k.shape[1] - 1  # the target's slots, then its sink row
        self.capacity, self.scratch = capacity, scratch
        # rows [0, capacity): the target's slots; capacity: the sink; (capacity, capacity + scratch]: draft steps
        self.store = KVStore(self.config.num_hidden_layers, capacity + scratch, self.n_kv, self.widths, target.dtype,
                             ctx.device)
        cp = self.groups.config.cp
        self.slot_positions = SlotPositions(cp, capacity + 1 + scratch) if self.config.local_attention else None
        # request id → [k, V] draft distributions of its last proposal, where the target's acceptance reads them
        self.q: dict[str, torch.Tensor] = getattr(target, "draft_probs", {})
        self.proposed: dict[str, _Proposed] = {}  # request id → where its last proposal's draft rows are

    # ------------------------------------------------------------------ one forward of the draft
    def _forward(self, batch: ForwardBatch) -> tuple[BatchAttention, torch.Tensor | None]:
        """Run the draft on `batch` (writing its new K/V into the given slots); (plan, hidden [L, hidden]) — hidden
        None when this rank has no token and no ring to serve."""
        g = self.groups
        if self.slot_positions is not None:
            self.slot_positions.record(batch)
        plan = BatchAttention(batch, g.cp_rank, g.config.cp, g.cp_group, self.target.backend, self.ctx.device,
                              self.slot_positions)
        if plan.idle:
            return plan, None
        store = self.store
        store.note_written(plan.slots)
        tables = plan.prepare(self.layout, self.windows, store.k.shape[1], self.chunks, self.widths.values_in_keys)
        tables.upload()
        ids, pos, slots = tables[("input_ids",)], tables[("positions",)], tables[("slots",)]  # [L] each

        def attn(layer: int, q, k, v, sinks=None, expand=None):  # q [L, H, D], k/v [L, Hkv, D]
            store.k[layer].index_copy_(0, slots, k)
            if not self.widths.values_in_keys:
                store.v[layer].index_copy_(0, slots, v)
            return plan.run(q, k, v, store.k[layer], store.v[layer], self.scale, None, self.windows[layer],
                            self.chunks[layer], sinks, store_used=store.used)

        attn.mla_form = "absorbed"
        with torch.inference_mode():
            return plan, self.model(ids, pos, attn)

    def mirror(self, batch: ForwardBatch) -> None:
        """The target's forward, run through the draft: the same tokens, positions and slots (no sampling). A
        sampled verify sequence on this rank whose q rows are not here (the KV manager put its verification on
        another rank than the one that drafted it) gets them from this forward: its rows 0 .. k-1 are the draft
        after [last, d_1 .. d_(i-1)], what the draft steps drew d_i from (up to rounding)."""
        seqs = tuple(self._reuse_drafted(s) for s in batch.seqs)
        self.proposed = {}
        plan, hidden = self._forward(dataclasses.replace(batch, seqs=seqs, cache_ops=()))
        me = self.groups.cp_rank
        for b, s in enumerate(batch.seqs):
            if (hidden is None or seqs[b] is not s or s.draft is None or not len(s.draft) or s.sample is None
                    or s.ranks[0] != me or s.sample.temperature < GREEDY_EPS or s.draft_key in self.q):
                continue
            rows = torch.as_tensor(int(plan.qoff[me, b]) + np.arange(len(s.draft)), device=hidden.device)
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[rows]).cpu()  # [k, V]
            self.q[s.draft_key] = torch.stack([draft_probs(row, _step_spec(s.sample, s.draft[:i].tolist()))
                                               for i, row in enumerate(logits)])

    def _reuse_drafted(self, s: SeqInput) -> SeqInput:
        """A verify sequence [last, d_1 .. d_m] placed on the rank that drafted it: the draft steps already computed
        the K/V of last .. d_(m-1) (scratch rows), which move to their slots; only d_m is left to run. Other
        sequences unchanged. Every rank decides alike (each knows every proposal's rank, rows and start)."""
        p = self.proposed.get(s.draft_key) if s.draft is not None else None
        m = 0 if s.draft is None else len(s.draft)
        if p is None or not m or m > p.k or p.start != s.start or bool((s.ranks != p.rank).any()):
            return s
        if self.groups.cp_rank == p.rank:
            dev = self.store.k.device
            src = torch.arange(p.row0, p.row0 + m, device=dev)
            dst = torch.as_tensor(s.slots[:m], device=dev)
            self.store.k[:, dst] = self.store.k[:, src]  # [layers, m, Hkv, Dk]
            if not self.widths.values_in_keys:
                self.store.v[:, dst] = self.store.v[:, src]
            self.store.note_written(s.slots[:m])
        runs = list(s.ctx_runs)
        moved = np.stack((s.slots[:m], s.slots[:m] + 1), axis=1)  # [m, 2] one run per moved slot
        runs[p.rank] = np.concatenate((np.asarray(runs[p.rank], dtype=np.int64).reshape(-1, 2), moved))
        return dataclasses.replace(s, token_ids=s.token_ids[m:], start=s.start + m, ranks=s.ranks[m:],
                                   slots=s.slots[m:], ctx_runs=tuple(runs), sample=None, next_token=-1,
                                   prompt_logprobs=False, prompt_top=0, draft=None, draft_key="",
                                   draft_allowed=None, draft_suppress=0)

    # ------------------------------------------------------------------ k draft-only steps
    def propose(self, seqs: tuple[DraftSeq, ...]) -> dict[str, np.ndarray]:
        """k decode steps of the draft for each request (every CP rank runs this together: a request whose K/V
        spread takes part in the ring). Returns the drafts of the requests this rank drafted."""
        me, n = self.groups.cp_rank, self.groups.config.cp
        base = self._scratch_rows(seqs)
        self.proposed = {s.key: _Proposed(s.rank, base[j], s.k, s.start) for j, s in enumerate(seqs)}
        fed = [s.token for s in seqs]  # the token each request feeds at the next step (known on its rank)
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for i in range(max((s.k for s in seqs), default=0)):
            live = [j for j, s in enumerate(seqs) if s.k > i]
            batch = ForwardBatch(tuple(self._step_input(seqs[j], i, base[j], fed[j], n) for j in live),
                                 "pass-q", "decode")
            if not any(x.spread for x in batch.seqs):
                batch = dataclasses.replace(batch, strategy="local")
            plan, hidden = self._forward(batch)
            rows = [(b, j) for b, j in enumerate(live) if seqs[j].rank == me]
            if hidden is None or not rows:
                continue
            idx = torch.as_tensor([int(plan.qoff[me, b]) for b, _ in rows], device=hidden.device)
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[idx]).cpu()  # [len(rows), V] fp32
            for (_, j), row in zip(rows, logits):
                s = seqs[j]
                if len(drafted[j]) < i:  # its drafting stopped (below); it still feeds a token, as every rank
                    continue  # builds the same step batches
                try:
                    token, q = self._draw(row, _step_spec(s.sample, drafted[j]))
                except Exception:  # noqa: BLE001 - e.g. its constraints allow no token: the drafts so far stand,
                    continue  # and the verification's own sampling reports the request's error
                drafted[j].append(token)
                fed[j] = token
                if q is not None:
                    probs[j].append(q)
        kept = self.q
        kept.clear()  # a proposal is verified in the step that made it: older q rows are stale
        out = {}
        for j, s in enumerate(seqs):
            if s.rank != me:
                continue
            out[s.key] = np.asarray(drafted[j], dtype=np.int64)
            if probs[j]:
                kept[s.key] = torch.stack(probs[j])  # [k, V]
        return out

    @staticmethod
    def _draw(logits: torch.Tensor, spec: SampleSpec) -> tuple[int, torch.Tensor | None]:
        """(drafted token, its distribution q [V] or None for a greedy request)."""
        if spec.temperature < GREEDY_EPS:
            return int(torch.argmax(scores_of(logits, spec)[1])), None
        q = draft_probs(logits, spec)
        gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step + _DRAFT_SALT) % (2 ** 63))
        return int(torch.multinomial(q, 1, generator=gen)), q

    def _scratch_rows(self, seqs: tuple[DraftSeq, ...]) -> list[int]:
        """The first scratch row of each request's k draft rows on its rank."""
        used = np.zeros(self.groups.config.cp, dtype=np.int64)
        base = []
        for s in seqs:
            base.append(self.capacity + 1 + int(used[s.rank]))
            used[s.rank] += s.k
        if used.max(initial=0) > self.scratch:
            raise ValueError(f"draft steps need {int(used.max())} scratch rows on a rank, the draft store has "
                             f"{self.scratch}")
        return base

    def _step_input(self, s: DraftSeq, i: int, row0: int, token: int, n: int) -> SeqInput:
        """Draft step i of request s: its fed token at position start + i into scratch row row0 + i, seeing its
        cached keys and its earlier draft rows."""
        runs = list(s.ctx_runs)
        if i:
            runs[s.rank] = np.concatenate((np.asarray(runs[s.rank], dtype=np.int64).reshape(-1, 2),
                                           [[row0, row0 + i]])).astype(np.int64)
        held = {r for r in range(n) if len(runs[r])} | {s.rank}
        one = np.ones(1, dtype=np.int64)
        return SeqInput(token * one, s.start + i, s.rank * one, (row0 + i) * one, tuple(runs), None,
                        spread=len(held) > 1)


# ---------------------------------------------------------------- functions the driver runs on every rank

def init_draft(ctx, draft_path: str | None, scratch: int = 0) -> dict:
    """Load the draft model beside this rank's target runner (None: drop any draft an earlier engine left)."""
    ctx.state.pop("draft", None)
    if draft_path is None:
        return {}
    runner = ctx.state["runner"]
    if runner.groups.config.tp != 1:
        raise ValueError("a draft model runs with tensor_parallel_size 1 only")
    draft = DraftRunner(ctx, runner, draft_path, scratch)
    ctx.state["draft"] = draft
    return {"draft_kv_bytes": draft.store.k.numel() * draft.store.k.element_size() * (
        1 if draft.widths.values_in_keys else 2)}


def propose(ctx, seqs: tuple[DraftSeq, ...]) -> dict[str, np.ndarray]:
    """Run the draft's k steps for `seqs` on this rank (all ranks together); the drafts this rank made."""
    return ctx.state["draft"].propose(seqs)


def mirror(ctx, batch: ForwardBatch) -> None:
    """The target's forward through the draft, when the engine has one (`model_runner.execute_batch`)."""
    draft = ctx.state.get("draft")
    if draft is not None:
        draft.mirror(batch)


def fill(ctx, batches: tuple[ForwardBatch, ...]) -> None:
    """Draft-only forwards (prefill chunks, no sampling) that write the draft's K/V of slots whose target rows came
    from elsewhere: a prefill group's handoff (`engine/pd/draft_rows.py`)."""
    draft = ctx.state["draft"]
    for batch in batches:
        draft._forward(batch)


def take_q(ctx, key: str) -> torch.Tensor | None:
    """The [k, V] draft distributions of request `key`'s last proposal, kept on this rank (None: greedy, or
    drafted elsewhere); removed once taken."""
    draft = ctx.state.get("draft")
    return None if draft is None else draft.q.pop(key, None)


def store_rows(ctx, slots=None, which: str = "draft") -> torch.Tensor:
    """K rows of this rank's draft (or "target") store at `slots` (None: all), [layers, len(slots), Hkv, Dk]
    (tests)."""
    store = ctx.state["draft"].store if which == "draft" else ctx.state["runner"].store
    k = store.k if slots is None else store.k[:, torch.as_tensor(np.asarray(slots, dtype=np.int64))]
    return k.detach().cpu().clone()
