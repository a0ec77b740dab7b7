"""The state cache of the hybrid (linear-attention) families: beside the paged KV of the attention layers, each
recurrent layer keeps per state slot its fp32 state [H, Dk, Dv] and its conv tail [kernel - 1, C] (the pre-conv
rows of the last kernel - 1 tokens).

A slot holds the state of one exact prefix of one sequence. The driver's `StateSlots` (owned by the KV manager,
`manager.py`) hands out slot ids: one live slot per running request (its state after every forward), and
snapshots: a finished request's live slot kept in the prefix tree at the position it describes, from which a later
request continues (`SeqKV.state_in`). Every CP rank keeps a replica of every slot (`StateStore`): the ranks
exchange what each needs to advance its replica in every recurrent layer (`engine/recurrent.py`), so no state ever
moves when the next token lands on another rank.

Speculative decoding: a verify forward runs a sequence's k + 1 tokens [last, d_1 .. d_k] and leaves the state after
all of them in its live slot; each replica also keeps the states (and tails) after each earlier token of the run
(`StateStore.keep`). Once the driver knows how many drafts were accepted, the next forward's batch names, per slot
that kept a rejected tail, how many of its last tokens to drop (`ForwardBatch.state_picks`): the replica copies the
state after the last kept token into the slot (`apply_picks`) before anything reads it, then forgets the rest.
"""
from __future__ import annotations

import torch
from torch import Tensor


class StateSlots:
    """The driver's slot ids: `alloc` the lowest free one (None when all `max_slots` are taken), `free` it back.
    `in_use` counts the slots taken (live and snapshots)."""

    def __init__(self, max_slots: int, bytes_per_slot: int = 0):
        if max_slots < 1:
            raise ValueError(f"the state cache needs at least one slot, got {max_slots}")
        self.max_slots, self.bytes_per_slot = max_slots, bytes_per_slot
        self._free = list(range(max_slots - 1, -1, -1))  # a stack: the lowest id on top
        self._taken: set[int] = set()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot < 0:
            return
        if slot not in self._taken:
            raise RuntimeError(f"state slot {slot} freed twice (this is a bug)")
        self._taken.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def in_use(self) -> int:
        return len(self._taken)

    @property
    def num_free(self) -> int:
        return len(self._free)


class StateStore:
    """One rank's replica of every state slot: per recurrent layer `states[layer]` [slots + 2, H, Dk, Dv] fp32 and
    `tails[layer]` [slots + 2, K-1, C] in the compute dtype, grown to the highest slot a batch names. Two spare rows
    follow the slots, for the static decode path's padding rows: `zero` (never written: a zero state and tail) and
    `sink` (written, never read). `version` counts the growths (a captured graph holds the old tensors)."""

    def __init__(self, layers: dict[int, tuple[tuple[int, int, int], int, int]], dtype: torch.dtype, device,
                 slots: int = 0):
        """layers: layer -> (state shape (H, Dk, Dv), conv kernel, conv channels)."""
        self.layers, self.dtype, self.device = dict(layers), dtype, device
        self.states: dict[int, Tensor] = {}
        self.tails: dict[int, Tensor] = {}
        self.slots = 0
        self.version = 0
        # speculative decoding: slot -> layer -> (states [T-1, H, Dk, Dv], tails [T-1, K-1, C]) after each token of
        # the last forward's verify run but its last (`keep`, `apply_picks`)
        self.kept: dict[int, dict[int, tuple[Tensor, Tensor]]] = {}
        for layer, (shape, kernel, channels) in self.layers.items():
            self.states[layer] = torch.zeros((2, *shape), dtype=torch.float32, device=device)
            self.tails[layer] = torch.zeros((2, kernel - 1, channels), dtype=dtype, device=device)
        self.ensure(slots)

    @property
    def zero(self) -> int:
        """The spare row that stays zero (a padding row's state and tail)."""
        return self.slots

    @property
    def sink(self) -> int:
        """The spare row padding rows write (never read)."""
        return self.slots + 1

    @staticmethod
    def bytes_per_slot(layers: dict[int, tuple[tuple[int, int, int], int, int]], dtype: torch.dtype) -> int:
        """One slot's bytes over every recurrent layer (fp32 state + tail in `dtype`)."""
        total = 0
        for (h, dk, dv), kernel, channels in layers.values():
            total += h * dk * dv * 4 + (kernel - 1) * channels * dtype.itemsize
        return total

    def ensure(self, slots: int) -> None:
        """Grow every layer's tensors to hold slot ids < slots (new slots zero)."""
        if slots <= self.slots:
            return
        slots = max(slots, 2 * self.slots)
        for layer in self.layers:
            for table in (self.states, self.tails):
                old = table[layer]
                new = old.new_zeros((slots + 2, *old.shape[1:]))  # the slots, then the spare rows
                new[:self.slots] = old[:self.slots]
                table[layer] = new
        self.slots = slots
        self.version += 1

    def load(self, layer: int, slot: int) -> tuple[Tensor | None, Tensor]:
        """(state [H, Dk, Dv] fp32 or None for a zero state, tail [K-1, C]) of a slot; slot -1: a sequence start."""
        if slot < 0:
            shape, kernel, channels = self.layers[layer]
            return None, torch.zeros((kernel - 1, channels), dtype=self.dtype, device=self.device)
        return self.states[layer][slot], self.tails[layer][slot]

    def save(self, layer: int, slot: int, state: Tensor, tail: Tensor) -> None:
        self.states[layer][slot].copy_(state)
        self.tails[layer][slot].copy_(tail)

    def keep(self, layer: int, slot: int, states: Tensor, tails: Tensor) -> None:
        """A verify run's states [T-1, H, Dk, Dv] and tails [T-1, K-1, C] after each of its tokens but the last
        (that one is in the slot), until the next forward's `apply_picks`."""
        self.kept.setdefault(slot, {})[layer] = (states, tails)

    def apply_picks(self, picks) -> None:
        """picks: (slot, drop) pairs: the slot's verify run kept all but its last `drop` tokens (a rejected draft):
        the state and tail after the last kept one go into the slot, in every layer. Then every kept state is
        forgotten (a verify's states serve the forward after it only)."""
        for slot, drop in picks:
            kept = self.kept.get(int(slot))
            if kept is None:
                raise RuntimeError(f"state slot {slot}: a rollback of {drop} tokens but no verify states were kept "
                                   "(this is a bug)")
            for layer, (states, tails) in kept.items():
                at = states.shape[0] - int(drop)  # states[i]: after token i; the run had states.shape[0] + 1 tokens
                if not 0 <= at < states.shape[0]:
                    raise RuntimeError(f"state slot {slot}: cannot drop {drop} of {states.shape[0] + 1} verify "
                                       "tokens (this is a bug)")
                self.save(layer, int(slot), states[at], tails[at])
        self.kept = {}
