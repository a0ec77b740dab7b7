"""Attention backends by name: the kernel that computes one ring step of a `cp_attention` plan and the merge.

`"auto"` (default; the env var CPINFER_ATTENTION_BACKEND overrides it) picks `cpu-flash` on CPU, `flash-attn` on
CUDA when that package is installed, else `triton`. `cpu-flash` and `math` (portable fp32 matmuls) and the thin
`flash-attn` wrapper run the plan's `AttnItem`s one call each and merge in fp32; `triton` runs a whole step in one
launch from the plan's tile table and metadata vectors (`triton_attention.py`). Device tables are built lazily,
once per plan and device, from the plan's `steps` and `step_vectors(j)`, so a plan built elsewhere runs too.
"""
from __future__ import annotations

import abc
import importlib.util
import os

import numpy as np
import torch

from cpinfer.attention.local import AttnItem, cpu_flash_backend, mark_first, run_items, sdpa_math_backend
from cpinfer.attention.merge import merge_partials

ENV_VAR = "CPINFER_ATTENTION_BACKEND"
NAMES = ("auto", "cpu-flash", "triton", "flash-attn", "math")


class StepBackend(abc.ABC):
    """Computes one ring step (a list of `AttnItem`s) into a running fp32 partial, and merges partials."""

    name: str

    @abc.abstractmethod
    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale: float, cache: dict | None = None,
                     key=None, window: int | None = None) -> None:
        """Merge q [Lq, H, D] against k/v [Lk, Hkv, D] under `items` into acc_out [Lq, H, D] fp32 and acc_lse
        [Lq, H] fp32 in place (rows no item touches stay as they are). `window`: the sliding window the items
        were planned with (items are exact by themselves; in-kernel backends apply it with the vectors).

        vectors: a callable returning the step's metadata (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos) as int64
        arrays in the items' row order, or None; read only by in-kernel backends (Triton without vectors runs in
        item mode: each FULL / CAUSAL item's rectangle is exact, MASK tiles go through `math`). cache: a dict that
        lives as long as the items (one forward) where device tables are kept under `key`, built once, not per layer.
        """

    def prepare(self, steps, vectors, device, g: int, cache: dict) -> None:
        """Build every step's device tables before the ring starts (no host work inside ring steps)."""

    def prepare_items(self, items, vectors, q, k, cache: dict, key) -> None:
        """Build the device tables `attend_items(items, vectors, q, k, ..., cache, key)` will use, now (call before
        the ring so that no host work or host-to-device copy happens inside a ring step)."""

    def attend(self, plan, j: int, q, k, v, acc_out, acc_lse, scale: float) -> None:
        """Step j of a plan (`plan.steps[j]`, `plan.step_vectors(j)` if it has one); tables cached on the plan."""
        sv = getattr(plan, "step_vectors", None)
        vectors = None if sv is None else (lambda: sv(j))
        self.attend_items(plan.steps[j], vectors, q, k, v, acc_out, acc_lse, scale, device_cache(plan), j,
                          getattr(plan, "window", None))

    def prepare_plan(self, plan, q, k) -> None:
        vectors = getattr(plan, "step_vectors", None)
        self.prepare(plan.steps, vectors, q.device, q.shape[1] // k.shape[1], device_cache(plan))

    def merge(self, outs, lses, out_dtype):
        """outs [S, L, H, D], lses [S, L, H] → (out [L, H, D] in out_dtype, lse [L, H] fp32)."""
        out, lse = merge_partials(list(outs), list(lses))
        return out.to(out_dtype), lse


class ItemBackend(StepBackend):
    """One kernel call per `AttnItem` (FULL / CAUSAL / MASK), merged into the accumulator in fp32."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, cache=None, key=None, window=None):
        if q.device.type != "cpu" and any(it.mask is not None for it in items):
            items = _cached(cache, ("items", key, str(q.device)), lambda: _items_on(items, q.device))
        run_items(items, q, k, v, acc_out, acc_lse, scale, self.kernel)

    def prepare(self, steps, vectors, device, g, cache):
        for j, items in enumerate(steps):
            self.prepare_items(items, None, torch.empty(0, device=device), None, cache, j)

    def prepare_items(self, items, vectors, q, k, cache, key) -> None:
        if q.device.type != "cpu" and any(it.mask is not None for it in items):
            _cached(cache, ("items", key, str(q.device)), lambda: _items_on(items, q.device))


class TritonBackend(StepBackend):
    """One Triton launch per ring step (tile table + in-kernel visibility) and a Triton merge for pass-Q."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None, min_programs: int | None = None,
                 split_keys: int | None = None):
        """min_programs: split-KV when a launch has fewer programs than this (default: 2 per GPU multiprocessor;
        never in the interpreter); split_keys: keys per split program (default: sized to reach min_programs)."""
        from cpinfer.attention import triton_attention

        self._kernels = triton_attention
        small = triton_attention.interpreting()  # the interpreter is fastest on small blocks
        self.block_m = block_m or (16 if small else 64)
        self.block_n = block_n or (16 if small else 64)
        self.min_programs, self.split_keys = min_programs, split_keys

    def _split_keys(self, table, hkv: int, device) -> int:
        """0 (no split) unless the launch is too small to fill the device; else keys per split program."""
        target = self.min_programs
        if target is None:
            target = 0 if device.type != "cuda" else 2 * torch.cuda.get_device_properties(device).multi_processor_count
        if table.num_programs * hkv >= target:
            return 0
        if self.split_keys:
            return self.split_keys
        work = int((table.k1 - table.k0).sum()) * hkv
        per = max(4 * self.block_n, -(-work // target))
        return -(-per // self.block_n) * self.block_n

    def _tables(self, items, vectors, device, g, hkv, cache, key):
        block_m = self._kernels.block_m_for(g, self.block_m)

        def build():
            vec, table, masked = step_tables(items, None if vectors is None else vectors(), device, block_m // g,
                                             lambda tab: self._split_keys(tab, hkv, torch.device(device)))
            return vec, table, masked

        return block_m, _cached(cache, ("triton", key, str(device), block_m // g, hkv, vectors is None), build)

    def prepare_items(self, items, vectors, q, k, cache, key) -> None:
        self._tables(items, vectors, q.device, q.shape[1] // k.shape[1], k.shape[1], cache, key)

    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, cache=None, key=None, window=None):
        block_m, (vec, (table, slots, n_slots), masked) = self._tables(
            items, vectors, q.device, q.shape[1] // k.shape[1], k.shape[1], cache, key)
        self._kernels.launch_step(q, k, v, acc_out, acc_lse, vec, table, scale, block_m, self.block_n,
                                  slots=slots, n_slots=n_slots, window=window)
        if masked:  # item mode: irregular MASK tiles through the portable kernel, merged (never stored)
            run_items(masked, q, k, v, acc_out, acc_lse, scale, sdpa_math_backend)

    def prepare_plan(self, plan, q, k) -> None:
        vectors = getattr(plan, "step_vectors", None)
        cache, g = device_cache(plan), q.shape[1] // k.shape[1]
        for j, items in enumerate(plan.steps):
            self._tables(items, None if vectors is None else (lambda j=j: vectors(j)), q.device, g, k.shape[1],
                         cache, j)

    def merge(self, outs, lses, out_dtype):
        from cpinfer.attention.triton_merge import triton_merge

        return triton_merge(outs, lses, out_dtype)


def flash_attn_kernel(q, k, v, causal, mask, scale):
    """Thin flash-attn (CUDA, fp16/bf16) wrapper with LSE; masked tiles and fp32 fall back to `math`.

    Written against flash-attn 2's `flash_attn_func(..., return_attn_probs=True)` → (out, lse [B, H, Lq], _);
    CAUSAL items are square, so its bottom-right causal alignment equals our top-left one. Not yet run here.
    """
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return sdpa_math_backend(q, k, v, causal, mask, scale)
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q[None], k[None], v[None], softmax_scale=scale, causal=causal,
                                  return_attn_probs=True)
    return out[0], lse[0].transpose(0, 1).float()  # [Lq, H, D], [Lq, H]


def resolve_name(name: str | None, device: torch.device) -> str:
    """The concrete backend for `name` on `device` ("auto" and the env var resolved); ValueError if unusable."""
    device = torch.device(device)
    name = name or "auto"
    if name == "auto":
        name = os.environ.get(ENV_VAR) or "auto"
        where = f" (from ${ENV_VAR})" if name != "auto" else ""
    else:
        where = ""
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}{where}; allowed: {', '.join(NAMES)}")
    if name == "auto":
        if device.type == "cpu":
            return "cpu-flash"
        return "flash-attn" if device.type == "cuda" and _has("flash_attn") else "triton"
    problem = _unusable(name, device)
    if problem:
        raise ValueError(f"attention backend {name!r}{where} cannot run on {device}: {problem}")
    return name


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _unusable(name: str, device: torch.device) -> str:
    if name == "cpu-flash" and device.type != "cpu":
        return "cpu-flash is the CPU kernel; use 'auto', 'triton', 'flash-attn' or 'math' on accelerators"
    if name == "flash-attn" and not (device.type == "cuda" and _has("flash_attn")):
        return "needs a CUDA device and the flash-attn package"
    if name == "triton":
        if not _has("triton"):
            return "the triton package is not installed"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton kernels need a GPU, or TRITON_INTERPRET=1 to run in Triton's CPU interpreter"
    return ""


_BACKENDS: dict[str, StepBackend] = {}


def get_step_backend(name: str | None, device) -> StepBackend:
    """The backend object for a name (instances are shared; they hold no per-plan state)."""
    concrete = resolve_name(name, device)
    if concrete not in _BACKENDS:
        if concrete == "triton":
            _BACKENDS[concrete] = TritonBackend()
        else:
            kernel = {"cpu-flash": cpu_flash_backend, "math": sdpa_math_backend,
                      "flash-attn": flash_attn_kernel}[concrete]
            _BACKENDS[concrete] = ItemBackend(concrete, kernel)
    return _BACKENDS[concrete]


def item_kernel(name: str | None, device):
    """The per-item kernel (q, k, v, causal, mask, scale) → (out, lse) of a backend, by name.

    For `triton` this is an adapter that launches the step kernel for one item (tables built per call): correct,
    but one launch per item and host work per call; `attend_items` runs a whole step in one launch instead.
    """
    backend = get_step_backend(name, device)
    if isinstance(backend, ItemBackend):
        return backend.kernel

    def one_item(q, k, v, causal, mask, scale):
        if mask is not None:  # an irregular tile: the portable kernel
            return sdpa_math_backend(q, k, v, causal, mask, scale)
        from cpinfer.attention.local import CAUSAL, FULL, new_accumulator

        acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], q.shape[2], q.device)
        item = AttnItem(0, q.shape[0], 0, k.shape[0], CAUSAL if causal else FULL)
        backend.attend_items([item], None, q, k, v, acc_out, acc_lse, scale)
        return acc_out, acc_lse

    return one_item


def backend_for(plan, device) -> StepBackend:
    """The backend a plan asks for (`plan.backend`, default "auto") on the device of its tensors."""
    return get_step_backend(getattr(plan, "backend", "auto"), device)


# ---------------------------------------------------------------- per-forward device tables

def device_cache(plan) -> dict:
    """A dict stored on the plan object (works for frozen dataclasses and plain objects alike)."""
    return plan.__dict__.setdefault("_device_cache", {})


def _cached(cache: dict | None, key, build):
    if cache is None:
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _items_on(items, device) -> list[AttnItem]:
    """Items with their MASK tiles copied to `device`."""
    return [it if it.mask is None else AttnItem(it.q0, it.q1, it.k0, it.k1, it.kind, it.mask.to(device), it.first)
            for it in items]


def device_send_index(plan, device) -> torch.Tensor:
    """The plan's packed-K/V row indices (me.send) as a device tensor, copied once."""
    return _cached(device_cache(plan), ("send", str(torch.device(device))),
                   lambda: torch.from_numpy(np.asarray(plan.me.send, dtype=np.int64)).to(device))


def step_tables(items, vectors, device, rows_per_prog: int, split=None):
    """Device inputs of the Triton kernel for one step (int32): (vectors, (table, slots, n_slots), masked).

    With vectors (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos): the union `tile_table`, every item in-kernel.
    Without (item mode): `item_table` of the FULL / CAUSAL items, and the MASK items (masks on the device,
    `first` cleared so they merge) returned as `masked` for the portable kernel.
    """
    from cpinfer.attention.local import MASK
    from cpinfer.attention.tiles import item_table, split_table, tile_table

    masked = []
    if vectors is not None:
        tab = tile_table(items, len(vectors[0]), rows_per_prog)
        vec = tuple(_int32_on(x, device, "metadata") for x in vectors)
    else:
        n_rows = max((it.q1 for it in items), default=0)
        tab = item_table([it for it in items if it.kind != MASK], n_rows, rows_per_prog)
        masked = _items_on([AttnItem(it.q0, it.q1, it.k0, it.k1, it.kind, it.mask)
                            for it in items if it.kind == MASK], device)
        vec = None
    split_keys = split(tab) if split is not None else 0
    slots, n_slots = None, 0
    if split_keys:  # split-KV for launches too small to fill the device (decode)
        tab, slot, n_slots = split_table(tab, split_keys)
        slots = _int32_on(slot, device, "split slots") if n_slots else None
    host = [tab.row0, tab.row1, tab.off, tab.k0, tab.k1, tab.r0, tab.r1, tab.diag]
    table = tuple(_int32_on(x, device, "tile table") for x in host)
    return vec, (table, slots, n_slots), masked


_INT32_LIMIT = 2 ** 30  # labels, positions, rows and keys below this; NO_DIAG sits at it


def _int32_on(x, device, what: str) -> torch.Tensor:
    """int32 device copy (the kernel's registers hold int32 metadata); values must stay within +-2^30."""
    a = np.asarray(x, dtype=np.int64)
    if a.size and (a.max() > _INT32_LIMIT or a.min() < -_INT32_LIMIT):
        raise ValueError(f"{what} values must lie within +-2^30 for the Triton kernel, got [{a.min()}, {a.max()}]")
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


class _OneStep:
    """A one-step plan (local attention): the items and, unless None, the vectors a backend reads."""

    def __init__(self, items, vectors, window=None):
        self.steps = [items]
        self.step_vectors = None if vectors is None else (lambda j: vectors)
        self.window = window


class LocalAttention:
    """Local (no communication) attention through a named backend, planned once and callable many times.

    Metadata [Lq] / [Lk] int64 (numpy or tensors); `__call__(q [Lq, H, D], k/v [Lk, Hkv, D], acc=None)` →
    (out [Lq, H, D] fp32, lse [Lq, H] fp32), merged into `acc` = (out, lse) when given (a later ring step).
    """

    def __init__(self, q_seq, q_pos, kv_seq, kv_pos, *, kv_seq_end=None, backend="auto", device="cpu",
                 scale=None, use_vectors: bool = True, window: int | None = None):
        from cpinfer.attention.local import _np, build_items, seq_end_or_default

        qs, qp, ks, kp = (_np(x) for x in (q_seq, q_pos, kv_seq, kv_pos))
        ke = seq_end_or_default(ks, kv_seq_end)
        items = build_items(qs, qp, ks, kp, ke, window)
        vectors = (qs, qp, ks, ke, kp) if use_vectors else None  # without: in-kernel backends use item mode
        self._fresh = _OneStep(items, vectors, window)  # rows without a partial yet may be overwritten
        self._merge = _OneStep(mark_first(items, len(qs), np.ones(len(qs), dtype=bool)), vectors, window)
        self.backend = get_step_backend(backend, device)
        self.scale = scale

    def __call__(self, q, k, v, acc=None):
        from cpinfer.attention.local import new_accumulator

        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        plan = self._fresh if acc is None else self._merge  # with acc every row holds a partial: merge only
        acc_out, acc_lse = acc if acc is not None else new_accumulator(q.shape[0], q.shape[1], q.shape[2], q.device)
        self.backend.attend(plan, 0, q, k, v, acc_out, acc_lse, scale)
        return acc_out, acc_lse


def attend_local(q, k, v, q_seq, q_pos, kv_seq, kv_pos, *, kv_seq_end=None, scale=None, backend="auto",
                 acc=None, use_vectors=True, window=None):
    """One-shot `LocalAttention`: q [Lq, H, D] against k/v [Lk, Hkv, D] → (out fp32, lse fp32), merged into acc."""
    step = LocalAttention(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_seq_end, backend=backend, device=q.device,
                          scale=scale, use_vectors=use_vectors, window=window)
    return step(q, k, v, acc)
