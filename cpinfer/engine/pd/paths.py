"""Walks of a request's path in a KV manager's prefix tree, for the P/D handoffs (paper §4.3): the (rank, slot) of
each of its positions, the ids of its segments, and removing segments no request uses."""
from __future__ import annotations

import numpy as np

from cpinfer.engine.kv.manager import KVManager, SeqKV


def path_nodes(node) -> list:
    """The segments from the root's child down to `node` (the root excluded), root first."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def nodes_layout(nodes: list) -> tuple[np.ndarray, np.ndarray]:
    """([S] rank, [S] slot) of these segments' positions, in order."""
    empty = [np.zeros(0, dtype=np.int64)]
    return (np.concatenate([n.rank.view for n in nodes] or empty),
            np.concatenate([n.slot.view for n in nodes] or empty))


def path_layout(seq: SeqKV) -> tuple[np.ndarray, np.ndarray]:
    """([S] rank, [S] slot) of positions 0 .. S-1 of a request's cached path (S = num_stored)."""
    ranks, slots = nodes_layout(path_nodes(seq.leaf))
    if len(ranks) != seq.num_stored:
        raise RuntimeError(f"path of {seq.request_id} holds {len(ranks)} tokens, expected {seq.num_stored} (a bug)")
    return ranks, slots


def path_ids(seq: SeqKV) -> set[int]:
    """Ids of the segments of a request's cached path (the root excluded)."""
    return {n.id for n in path_nodes(seq.leaf)}


def drop_unused(kv: KVManager, ids: set[int]) -> None:
    """Remove these segments from the tree, leaves first, as far as no request uses them."""
    changed = True
    while changed:
        changed = False
        for nid in list(ids):
            node = kv.nodes.get(nid)
            if node is not None and node.ref == 0 and node.owner is None and not node.children:
                kv._free_node(node)
                ids.discard(nid)
                changed = True
