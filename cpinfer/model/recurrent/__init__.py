"""Recurrent (linear-attention) layers of the hybrid families, and how they stay exact under context parallelism.

The contract every recurrence here keeps (Gated DeltaNet `gdn.py`, Kimi Delta Attention `kda.py`, Mamba-2 `mamba2.py`):

* A run of T tokens of one sequence maps an incoming state S_in (fp32, per head) to T outputs and an outgoing state,
  and the outgoing state is affine in the incoming one:

      S_out = M · S_in + B

  For the delta rules (GDN, KDA) S is [H, Dk, Dv], M is [H, Dk, Dk] acting on the left (the product of every token's
  g_t (I - beta_t k_t k_t^T), with KDA's decay per key channel), B is [H, Dk, Dv] (the run from a zero state).
  For Mamba-2 S is [H, P, N] (head dim x state size) and M is [H] (a per-head decay, the product of exp(dt_t A)).
* Each module exposes, for one sequence with heads batched, all fp32:
      run(<inputs>, state)      -> (outputs [T, H, Dv], state_out)   the exact (chunked) form from a given state
      summary(<inputs>)         -> Affine(M, B)                      the run's map, from zero state / identity
  `affine.py` holds `Affine`, applying a map to a state and composing maps in sequence order.
* Under CP a sequence's tokens are sharded (paper §3.5.1: 2N chunks, rank i holds chunks i and 2N-1-i). Each rank
  computes the summaries of its shards, the ranks exchange them (fixed size, independent of the sequence length),
  each composes its predecessors' maps into the starting state of each shard, then runs its shards from those
  states. Every rank can also compose all maps into the sequence's final state. The causal conv1d before the
  recurrence needs the `kernel - 1` inputs preceding each shard (a halo), exchanged the same way.

The engine keeps each running request's final states (and the conv tails) in the state cache
(`engine/kv/state_store.py`) so that the next turn starts from them.
"""
