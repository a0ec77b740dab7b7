"""What the engine does differently for the hybrid (linear-attention) families, and what it refuses for them.

Hybrid models keep, beside the attention layers' paged KV, a fixed-size state per request and recurrent layer
(`kv/state_store.py`; driver slots owned by the KV manager, replicas on every CP rank, `engine/recurrent.py`).
Engine features that move, roll back or capture K/V do not carry those states yet, so each is refused before any
rank starts, naming it (never silently wrong).
"""
from __future__ import annotations

SNAPSHOT_SLOTS = 64  # state slots beyond the live ones, for snapshots kept in the prefix tree


def state_slots(max_num_seqs: int) -> int:
    """State slots an engine keeps: a live one per running request (and one per request being re-attached while
    another holds its prefix), plus SNAPSHOT_SLOTS for finished requests' states."""
    return 2 * max_num_seqs + SNAPSHOT_SLOTS


def unsupported(config, args, pd_role: bool = False) -> str | None:
    """The first engine feature asked for that a hybrid model cannot run with yet (None: none)."""
    if not config.hybrid:
        return None
    if args.tensor_parallel_size > 1:
        return (f"tensor_parallel_size={args.tensor_parallel_size} (tensor parallelism does not slice the recurrent "
                "layers yet): use tensor_parallel_size=1 and context_parallel_size for more devices")
    return None


def check(config, args, pd_role: bool = False) -> None:
    """ValueError naming the feature when a hybrid model is asked to run with one it does not support yet."""
    problem = unsupported(config, args, pd_role)
    if problem is not None:
        raise ValueError(f"model_type {config.model_type!r} is a hybrid (linear-attention) model; cpinfer does not "
                         f"run it with {problem}")


def state_bytes_per_slot(config, elem_bytes: int) -> int:
    """One state slot's bytes on a rank: per recurrent layer the fp32 state and the conv tail (compute dtype). The
    mixer config (`config.recurrent`) gives `state_shape` (H, Dk, Dv), `conv_kernel` and `conv_channels`."""
    r = config.recurrent
    h, dk, dv = r.state_shape
    return len(config.recurrent_layers) * (h * dk * dv * 4 + (r.conv_kernel - 1) * r.conv_channels * elem_bytes)


def state_bytes(config, elem_bytes: int, max_num_seqs: int) -> int:
    """The state cache's bytes on each rank (every rank keeps a replica of every slot)."""
    return state_slots(max_num_seqs) * state_bytes_per_slot(config, elem_bytes)
