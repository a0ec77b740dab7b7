"""The scheduler and the KV manager without ranks: a fake forward (sampled tokens are random) drives random
add / step / finish / abort / evict / preempt sequences under each placement (shard, local, auto); after every step
the cache is recounted from the tree and every placement is checked against where the sequence's keys are."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpinfer.cp.sharding import chunk_ranks
from cpinfer.engine.kv.manager import BLOCK, KVManager
from cpinfer.engine.kv.placement import SPREAD, CostModel, Placer
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.model_spec import ModelSpec
from cpinfer.engine.request import Request, RequestStatus
from cpinfer.engine.sampling import SamplingParams
from cpinfer.engine.scheduler import Scheduler, SchedulerConfig


class FakeEngine:
    """The driver's bookkeeping of LLMEngine.step with the forward replaced by random tokens."""

    def __init__(self, n, capacity, budget, seed, max_num_seqs=8, placement="shard", preferred_rank=None):
        self.kv = KVManager(n, capacity, placer=make_placer(placement, n), preferred_rank=preferred_rank)
        self.mode = placement
        self.sched = Scheduler(self.kv, SchedulerConfig(budget, max_num_seqs))
        self.rng = np.random.default_rng(seed)
        self.live: dict[str, Request] = {}
        self.ids = 0

    def add(self, prompt, max_tokens):
        rid = f"r{self.ids}"
        self.ids += 1
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), seed=0)
        self.live[rid] = req
        self.sched.add(req)
        return req

    def step(self):
        scheduled = self.sched.schedule()
        for s in scheduled:  # what the ranks are told: every slot distinct, on the right rank, runs cover the path
            assert len(np.unique(s.placement.ranks * 10**9 + s.placement.slots)) == len(s.tokens)
            assert s.start + len(s.tokens) == s.request.num_stored
            assert sum(int(np.sum(r[:, 1] - r[:, 0])) for r in s.ctx_runs) == s.start
            check_placement(s, self.mode)
        for s in scheduled:
            req = s.request
            if s.sample:
                req.out.append(int(self.rng.integers(3, 50)))
                if len(req.out) >= req.params.max_tokens:
                    self.sched.finish(req, keep_cache=True)
                    del self.live[req.request_id]
        return scheduled

    def abort(self, req):
        self.sched.finish(req, keep_cache=False)
        del self.live[req.request_id]

    def check(self):
        self.kv.check_invariants()
        running = [r for r in self.live.values() if r.status is RequestStatus.RUNNING]
        refs = {}
        for r in running:  # ref counts = running requests whose path holds the node; their keys are all still there
            node, path_slots = r.kv.leaf, []
            while node is not self.kv.root:
                refs[node.id] = refs.get(node.id, 0) + 1
                path_slots.append(node.rank.view * 10**9 + node.slot.view)
                node = node.parent
            flat = np.sort(np.concatenate(path_slots)) if path_slots else np.zeros(0, dtype=np.int64)
            runs = np.sort(np.concatenate([rank * 10**9 + np.concatenate([np.arange(a, e) for a, e in rr] or [[]])
                                           for rank, rr in enumerate(r.kv.runs)]).astype(np.int64))
            np.testing.assert_array_equal(flat, runs)
            assert len(flat) == r.num_stored
        for nid, node in self.kv.nodes.items():
            assert node.ref == refs.get(nid, 0), (nid, node.ref, refs.get(nid, 0))
        promised = np.zeros(self.kv.n, dtype=np.int64)  # decode tokens local requests may still add, per rank
        for r in running:
            if r.kv.promised:
                assert r.kv.promised_on == r.kv.home >= 0
                promised[r.kv.home] += r.kv.promised
        np.testing.assert_array_equal(self.kv.promised, promised)


SMOL = ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True)


def make_placer(mode: str, n: int) -> Placer:
    """The policy as the engine builds it (auto: the embedded model's shape on the cpu-gloo profile)."""
    if mode != "auto" or n == 1:
        return Placer(mode, n)
    return Placer("auto", n, CostModel(SMOL, load_hardware_profile("cpu-gloo"), n, compute_share=1 / n))


def check_placement(s, mode):
    """A placement agrees with where the sequence's keys are: `spread` iff its old and new keys span ranks; a local
    sequence's decode token stays with its keys (unless its rank is full); `shard` spreads every prefill."""
    pl = s.placement
    before = {r for r, runs in enumerate(s.ctx_runs) if len(runs)}
    after = before | set(pl.ranks.tolist())
    assert pl.spread == (len(after) > 1), (before, pl.ranks, pl.spread)
    assert s.request.kv.home == (SPREAD if len(after) > 1 else min(after))
    if s.is_decode and len(before) == 1 and mode != "shard" and (pl.decision is None
                                                                  or pl.decision.method != "capacity"):
        assert pl.ranks.tolist() == list(before)
    if mode == "shard" and not s.is_decode and pl.decision is not None:
        assert pl.decision.spread
    if mode == "local" and pl.decision is not None:
        assert pl.decision.method in ("forced", "capacity") and (pl.decision.method == "capacity"
                                                                 or not pl.decision.spread)


ops = st.lists(st.tuples(st.sampled_from(["add", "add_shared", "step", "step", "step", "abort"]),
                         st.integers(0, 10**6)), min_size=5, max_size=60)


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, n=st.integers(1, 4), budget=st.sampled_from([None, 7, 40]), seed=st.integers(0, 1000),
       mode=st.sampled_from(["shard", "local", "auto"]))
def test_random_workloads_keep_the_cache_consistent(ops, n, budget, seed, mode):
    eng = FakeEngine(n, capacity=6 * BLOCK, budget=budget, seed=seed, placement=mode)
    doc = list(range(3, 3 + 150))
    for op, x in ops:
        if op == "add":
            eng.add(np.random.default_rng(x).integers(3, 60, 1 + x % 120).tolist(), 1 + x % 30)
        elif op == "add_shared":  # a question on the shared document, or a branch off its middle
            cut = len(doc) if x % 2 else x % len(doc) + 1
            eng.add(doc[:cut] + [60 + x % 7] * (1 + x % 5), 1 + x % 20)
        elif op == "abort" and eng.live:
            eng.abort(list(eng.live.values())[x % len(eng.live)])
        else:
            eng.step()
        eng.check()
    for _ in range(2000):  # everything left finishes: nothing stalls, and then no block is referenced
        if not eng.live:
            break
        assert eng.step(), "scheduler stalled with work left"
        eng.check()
    assert not eng.live
    assert all(node.ref == 0 for node in eng.kv.nodes.values()) and not eng.kv.promised.any()
    used = np.asarray(eng.kv.tokens_per_rank())
    if mode == "shard":
        assert used.max() - used.min() <= BLOCK, used  # balanced over the ranks within one block


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 300), min_size=8, max_size=50), n=st.integers(2, 4),
       mode=st.sampled_from(["local", "auto"]), arrivals=st.integers(1, 6), preferred=st.sampled_from([None, 0]))
def test_local_placements_keep_ranks_balanced(sizes, n, mode, arrivals, preferred):
    """Requests kept whole on one rank go to the least-loaded one (KV tokens, the decode tokens its local requests
    may still add, and this forward's new tokens once more for their compute), or to the preferred rank (the
    driver's) when nothing local is in flight and that is less than the request ahead: per-rank usage stays within
    twice the largest request (so within one block per request once there are more requests than that has
    blocks), in tokens and in blocks (each request leaves at most one part-filled block)."""
    eng = FakeEngine(n, capacity=(2 * sum(sizes) // n + 64 * len(sizes)) // BLOCK * BLOCK, budget=None, seed=3,
                     max_num_seqs=64, placement=mode, preferred_rank=preferred)
    rng = np.random.default_rng(len(sizes))
    largest = 0
    for i, size in enumerate(sizes):
        outs = 1 + i % 4
        eng.add([1000 + i] + rng.integers(3, 60, size - 1).tolist(), outs)  # distinct: no prefix shared
        largest = max(largest, size + outs)
        if i % arrivals == 0:
            eng.step()
            eng.check()
    while eng.live:
        assert eng.step()
        eng.check()
    used = np.asarray(eng.kv.tokens_per_rank())
    assert used.sum() == sum(sizes) + sum(i % 4 for i in range(len(sizes)))  # nothing evicted, nothing lost
    assert used.max() - used.min() <= 2 * largest, used
    blocks = np.asarray([eng.kv.num_blocks - r.num_free for r in eng.kv.ranks])
    assert blocks.max() - blocks.min() <= -(-2 * largest // BLOCK) + len(sizes) / n + 1, blocks


def test_a_local_request_needs_its_blocks_on_one_rank():
    """Per-rank admission: a request kept on one rank waits until one rank can hold it (not the sum over ranks),
    and eviction frees room on that rank only."""
    eng = FakeEngine(2, capacity=4 * BLOCK, budget=None, seed=0, placement="local")
    a = eng.add(list(range(3, 203)), 40)  # 200 + 40 tokens: rank 0
    b = eng.add(list(range(4, 204)), 80)  # rank 1
    eng.step()
    assert a.kv.home == 0 and b.kv.home == 1
    c = eng.add(list(range(5, 155)), 2)  # 150 tokens: 56 free on each rank, 112 in all, neither alone
    while a.request_id in eng.live:
        eng.step()
        eng.check()
        assert c.kv is None  # not admitted while no single rank (nor both together) can hold it
    b_slots = b.kv.leaf.slot.view.copy()
    eng.step()  # a finished: its cached tokens on rank 0 are evicted for c; b's stay
    assert c.kv is not None and c.kv.home == 0 and eng.kv.tokens_per_rank()[0] == 150
    np.testing.assert_array_equal(b.kv.leaf.slot.view[:len(b_slots)], b_slots)
    assert eng.sched.num_preemptions == 0
    eng.check()


def test_a_full_rank_spills_decode_tokens_instead_of_preempting():
    eng = FakeEngine(2, capacity=4 * BLOCK, budget=None, seed=0, placement="local")
    a = eng.add(list(range(3, 203)), 100)  # 200 prompt + 100 output > one rank's 256 slots
    while eng.live:
        scheduled = eng.step()
        eng.check()
        if a.kv is not None and a.num_stored == 257:
            spill = [s for s in scheduled if s.request is a][0].placement
            assert spill.ranks.tolist() == [1] and spill.spread and spill.decision.method == "capacity"
    assert eng.sched.num_preemptions == 0 and len(a.out) == 100
    assert eng.kv.tokens_per_rank() == [256, 299 - 256]


def test_shared_prefix_stored_once_and_split_relabels_only():
    kv = KVManager(2, 16 * BLOCK)
    eng = FakeEngine(2, 16 * BLOCK, None, 0)
    eng.kv = kv
    eng.sched.kv = kv
    doc = list(range(3, 203))
    a = eng.add(doc + [1, 2], 3)
    b = eng.add(doc + [9, 9, 9], 3)  # arrives with a: matches a's tokens placed in the same step
    first = eng.step()
    assert [len(s.tokens) for s in first] == [202, 3] and b.num_cached == 200
    slots_of_doc = sorted(zip(a.kv.leaf.parent.rank.view.tolist(), a.kv.leaf.parent.slot.view.tolist()))
    c = eng.add(doc[:100] + [7], 2)  # splits the shared segment at 100: no slot changes
    eng.step()
    parent = a.kv.leaf.parent
    after = sorted(zip(parent.parent.rank.view.tolist() + parent.rank.view.tolist(),
                       parent.parent.slot.view.tolist() + parent.slot.view.tolist()))
    assert after == slots_of_doc and c.num_cached == 100
    assert sum(kv.tokens_per_rank()) == 202 + 3 + 1 + 2 * 1  # doc once, three suffixes, fed decode tokens
    eng.check()


def test_preemption_frees_the_newest_and_it_resumes():
    eng = FakeEngine(2, 4 * BLOCK, None, 1)  # 256 slots per rank
    old = eng.add(list(range(3, 203)), 100)
    new = eng.add(list(range(5, 205)), 100)
    for _ in range(400):
        if not eng.live:
            break
        eng.step()
        eng.check()
    assert eng.sched.num_preemptions >= 1 and new.num_preemptions >= 1 and old.num_preemptions == 0
    assert len(old.out) == 100 and len(new.out) == 100


def test_a_request_that_can_never_fit_is_reported():
    kv = KVManager(2, 4 * BLOCK)
    assert kv.blocks_for_request(4 * BLOCK * 2) > kv.num_blocks  # 512 tokens over 2 ranks of 256 slots


@pytest.mark.parametrize("t, n", [(1, 1), (7, 2), (64, 2), (1000, 3), (5, 4)])
def test_chunk_ranks_is_2n_balanced(t, n):
    ranks = chunk_ranks(t, n, list(range(n)))
    counts = np.bincount(ranks, minlength=n)
    assert counts.sum() == t and counts.max() - counts.min() <= max(1, 2 * n)
    size = -(-t // (2 * n))  # chunk k and 2N-1-k share a rank
    for k in range(2 * n):
        part = ranks[k * size:(k + 1) * size]
        assert len(set(part.tolist())) <= 1
        mirror = ranks[(2 * n - 1 - k) * size:(2 * n - k) * size]
        if len(part) and len(mirror):
            assert part[0] == mirror[0]


def test_bad_manager_arguments():
    with pytest.raises(ValueError, match="at least 64"):
        KVManager(2, 10)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(0)


def test_a_burst_goes_whole_to_both_ranks_and_a_long_prompt_among_it_spreads():
    """The scheduler tells the placement the forward's whole work (its floor): 32 short prompts arriving together
    are kept whole, 16 per rank, with no ring; a 16K prompt with them is still spread."""
    eng = FakeEngine(2, capacity=32 * 1024, budget=None, seed=0, max_num_seqs=64, placement="auto")
    shorts = [eng.add([1000 + i] + [5] * 499, 32) for i in range(32)]
    eng.step()
    assert [s.kv.home for s in shorts].count(0) == 16 and [s.kv.home for s in shorts].count(1) == 16
    alone = FakeEngine(2, capacity=32 * 1024, budget=None, seed=0, placement="auto")
    one = alone.add([7] * 500, 32)
    alone.step()
    assert one.kv.home == SPREAD  # alone, halving its prefill beats the ring of 31 decode steps
    eng = FakeEngine(2, capacity=32 * 1024, budget=None, seed=0, max_num_seqs=64, placement="auto")
    long = eng.add([9] * 16384, 32)
    shorts = [eng.add([1000 + i] + [5] * 499, 32) for i in range(32)]
    eng.step()
    assert long.kv.home == SPREAD and all(s.kv.home >= 0 for s in shorts)
    homes = [s.kv.home for s in shorts]
    assert abs(homes.count(0) - homes.count(1)) <= 2
    eng.check()


def test_a_lone_request_goes_to_the_preferred_rank_unless_that_unbalances_the_ranks():
    """With rank 0 in the driver process preferred: a request arriving while nothing else runs goes there even
    when earlier requests' cached tokens make it a little more loaded (its decode steps then need no message to
    another process), but not once rank 0 is as far ahead as the request itself, and not while other requests are
    in flight (a burst is balanced by least load: rank 0 gains nothing in a forward other ranks work in too)."""
    eng = FakeEngine(2, capacity=32 * BLOCK, budget=None, seed=0, max_num_seqs=8, placement="local",
                     preferred_rank=0)
    homes, ahead = [], []
    for size in (100, 150, 120, 400, 50):  # one at a time, each finished before the next arrives
        used = eng.kv.tokens_per_rank()
        ahead.append(used[0] - used[1])
        req = eng.add([7000 + size] + list(range(3, 2 + size)), 4)
        eng.step()
        homes.append(req.kv.home)
        while req.request_id in eng.live:
            eng.step()
        eng.check()
    # rank 0 (cached tokens ahead of rank 1 → the request's tokens with its answer): 0 → 104, 103 → 154, then
    # 256 ≥ 124: rank 1; 133 → 404: rank 0 again; 536 ≥ 54: rank 1
    assert ahead == [0, 103, 256, 133, 536] and homes == [0, 0, 1, 0, 1], (ahead, homes)
    fresh = FakeEngine(2, capacity=32 * BLOCK, budget=None, seed=0, max_num_seqs=8, placement="local",
                       preferred_rank=0)
    burst = [fresh.add([8000 + i] + list(range(3, 60)), 4) for i in range(4)]  # together: least load decides
    fresh.step()
    assert [r.kv.home for r in burst] == [0, 1, 0, 1]
    while fresh.live:
        fresh.step()
    fresh.check()
    plain = FakeEngine(2, capacity=32 * BLOCK, budget=None, seed=0, placement="local")  # no preference
    first = plain.add(list(range(3, 103)), 4)
    while plain.live:
        plain.step()
    second = plain.add(list(range(200, 350)), 4)
    plain.step()
    assert first.kv is None and second.kv.home == 1  # least loaded, whatever the size


def test_eviction_frees_the_rank_that_needs_room():
    """A local sequence growing on its rank evicts cached segments of that rank only, even when an older cached
    segment sits on another rank (LRU over the whole cache would evict that one first, for nothing)."""
    kv = KVManager(2, 4 * BLOCK, placer=Placer("local", 2))
    x = kv.attach("x", np.arange(3, 104))
    kv.begin_forward()
    assert kv.reserve(x, np.arange(3, 103)).ranks.tolist() == [0] * 100
    a = kv.attach("a", np.arange(1000, 1151))
    assert set(kv.reserve(a, np.arange(1000, 1150)).ranks.tolist()) == {1}
    kv.release(a, keep=True)  # cached on rank 1, the older
    d = kv.attach("d", np.arange(2000, 2065))
    assert set(kv.reserve(d, np.arange(2000, 2064)).ranks.tolist()) == {0}
    kv.release(d, keep=True)  # cached on rank 0, the newer
    a_node, d_node = a.leaf, d.leaf
    grown = kv.reserve(x, np.arange(5000, 5150))  # x's next 150 tokens need 2 more blocks on rank 0
    assert grown.ranks.tolist() == [0] * 150 and not grown.spread
    assert a_node.id in kv.nodes and d_node.id not in kv.nodes
    kv.check_invariants()


@pytest.mark.parametrize("n", [1, 2])
def test_without_prefix_caching_finished_requests_free_their_blocks_at_once(n):
    """--no-prefix-caching: the cache is never reused, so a finished request's K/V is not kept (the KV gauge
    returned to 0 → 23,720 per rank after a storm with nothing running)."""
    eng = FakeEngine(n, 16 * BLOCK, None, 0)
    eng.kv = KVManager(n, 16 * BLOCK, enable_prefix_caching=False)
    eng.sched.kv = eng.kv
    idle = eng.kv.tokens_per_rank()
    assert idle == [0] * n
    for k in range(6):
        eng.add(list(range(3, 60 + 7 * k)), 1 + k % 3)
    while eng.live:
        eng.step()
        eng.check()
    assert eng.kv.tokens_per_rank() == idle
    assert eng.kv.free_blocks().tolist() == [eng.kv.num_blocks] * n
    # with caching on, the same finished requests stay cached (what the prefix tree is for)
    cached = FakeEngine(n, 16 * BLOCK, None, 0)
    cached.add(list(range(3, 60)), 2)
    while cached.live:
        cached.step()
    assert sum(cached.kv.tokens_per_rank()) == 57 + 1  # the prompt and the first output token (fed to decode)


def test_check_room_refuses_what_an_empty_cache_cannot_hold_and_names_the_knob():
    kv = KVManager(2, 4 * BLOCK)
    kv.check_room(3 * BLOCK, BLOCK)  # fits: nothing raised
    with pytest.raises(ValueError, match=r"KV tokens per rank \(prompt 1000, max_tokens 50, CP=2\) but each rank "
                                         r"holds 256; raise max_kv_tokens_per_rank or context_parallel_size"):
        kv.check_room(1000, 50)
    with pytest.raises(ValueError, match=r"per rank on a decode group \(prompt 1000, max_tokens 50, pd_decode_cp=2\)"
                                         r" .* raise max_kv_tokens_per_rank or pd_decode_cp, or shorten"):
        kv.check_room(1000, 50, " on a decode group", "pd_decode_cp=2")


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("capacity", [64, 128, 256, 2048, 4160])
def test_request_tokens_held_is_the_longest_request_check_room_admits(n, capacity):
    """The bound a max_model_len is fitted to at start-up (engine/startup.py): every request within it fits an empty
    cache, one token more does not."""
    from cpinfer.engine.kv.manager import request_tokens_held

    kv = KVManager(n, capacity)
    held = request_tokens_held(n, capacity)
    assert kv.request_tokens_held == held
    if held > 0:
        kv.check_room(held - 1, 1)
    with pytest.raises(ValueError, match="KV tokens per rank"):
        kv.check_room(held, 1)
