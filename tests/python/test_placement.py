"""Tests of expert placement and replicas from Python (epx.h, "Expert
placement and replicas"; epx.placement, epx.torch.elastic): the bindings
exact against the C behaviour (the planner deterministic, serving every
expert, within its skew bound; rank_load the load model's sums; the
round-robin rule's counts; the replicas' gradient sum and the weight move
exact), an MoE layer under a replicated placement on local thread ranks
giving the contiguous layer's outputs and gradients (after the gradient
sum, replicas agree bit for bit), a layer's move there and back exact, and
errors naming their argument.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_placement.py
"""
import ctypes
import pathlib
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import epx  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402


def skewed_load(E, seed=5):
    """A skewed load: exp(normal), a few experts several ranks' worth."""
    return 1000.0 * np.exp(np.random.default_rng(seed).standard_normal(E))


def python_rank_load(p2l, rank_of, E, W, load):
    """The load model (each replica takes an equal share), summed in the
    library's order (physical ids ascending): the same doubles."""
    n = np.bincount(p2l, minlength=E)
    out = [0.0] * W
    for p in range(len(p2l)):
        out[rank_of[p]] += load[p2l[p]] / n[p2l[p]]
    return np.array(out)


# ---------------------------------------------------------------------------
# The placement, the planner and its load model
# ---------------------------------------------------------------------------


def test_placement_mirrors_the_c_struct():
    pl = epx.Placement([0, 1, 2, 3, 0, 1], num_ranks=2)
    assert (pl.num_physical, pl.num_experts, pl.num_ranks) == (6, 4, 2)
    assert pl.replica_rule == epx.EPX_REPLICA_ROUND_ROBIN and pl.physical_rank is None
    assert pl.physical_to_logical.dtype == np.int32 and not pl.physical_to_logical.flags.writeable
    assert list(pl.ranks()) == [0, 0, 0, 1, 1, 1]
    assert list(pl.local_experts(1)) == [3, 4, 5] and list(pl.local_logical(1)) == [3, 0, 1]
    assert list(pl.replicas(0)) == [0, 4] and list(pl.replicas(2)) == [2]
    assert epx.Placement.contiguous(4, 2).is_contiguous and not pl.is_contiguous
    assert epx.Placement.contiguous(4, 2) == epx.Placement(np.arange(4), [0, 0, 1, 1])
    given = epx.Placement([1, 0, 2, 3], [1, 0, 0, 1], epx.ReplicaRule.CALLER)
    assert given.num_ranks == 2 and list(given.local_experts(0)) == [1, 2]
    s = given._struct
    assert (s.num_physical, s.replica_rule) == (4, 1) and s.physical_rank
    assert epx.BufferConfig().placement is None  # the last field: NULL, the contiguous map
    with pytest.raises(ValueError, match="BufferConfig.placement is a Placement; pass an "
                                         "epx.Placement as Buffer"):
        epx.BufferConfig(placement=pl)
    # a config holding the address of an epx_placement_t: the buffer reads it back
    one = epx.Placement([0, 1, 0], num_ranks=1)
    config = epx.BufferConfig(hidden=8, num_experts=2, max_top_k=1,
                              placement=ctypes.addressof(one._struct))
    with epx.Comm.create_self() as comm, comm.buffer(config) as buf:
        assert buf.placement == one and buf.experts_per_rank == 3


@pytest.mark.parametrize("nodes", [1, 2])
def test_plan_is_deterministic_serves_every_expert_and_balances(nodes):
    """The C test's scene (256 experts, 16 ranks, 8 groups): the same plan
    twice, every expert served, no worse than contiguous or than no
    redundancy, and within 1.10 of perfect balance from 32 redundant
    experts; node-aware: every replica of an expert on one node."""
    E, W = 256, 16
    load = skewed_load(E)
    before = epx.Placement.contiguous(E, W).skew(load)
    first = None
    for R in (0, 16, 32, 64):
        pl = epx.Placement.plan(load, E + R, W, num_nodes=nodes, num_groups=8)
        assert pl == epx.Placement.plan(list(load), E + R, W, nodes, 8)
        assert pl.num_physical == E + R and pl.num_ranks == W
        assert np.bincount(pl.physical_to_logical, minlength=E).min() >= 1
        skew = pl.skew(load)
        first = skew if first is None else first
        assert skew <= before + 1e-12 and skew <= first + 1e-9
        if R >= 32:
            assert skew <= 1.10, (R, skew)
        if nodes == 2:
            node = np.arange(E + R) // ((E + R) // 2)
            for e in range(E):
                assert len(set(node[pl.replicas(e)])) == 1
    assert before > 1.5  # the scene is skewed


def test_rank_load_is_the_load_model_exactly():
    E, W = 16, 4
    load = skewed_load(E, seed=SEED)
    for pl in (epx.Placement.plan(load, 24, W), epx.Placement.contiguous(E, W),
               epx.Placement(np.r_[np.arange(E), [3, 3, 7, 0]][::-1].copy(),
                             np.arange(20) % W, num_ranks=W)):
        got = pl.rank_load(load)
        want = python_rank_load(pl.physical_to_logical, pl.ranks(W), E, W, load)
        assert np.array_equal(got, want)
        assert pl.skew(load) == got.max() / got.mean()
    # integer counts (Buffer.expert_load's) are loads too
    counts = np.arange(E, dtype=np.int64)
    assert np.array_equal(epx.Placement.contiguous(E, W).rank_load(counts),
                          [6.0, 22.0, 38.0, 54.0])


# ---------------------------------------------------------------------------
# A buffer under a placement (numpy): counts, gradient sum, move
# ---------------------------------------------------------------------------

E_, W_, K_, T_, H_ = 8, 2, 2, 12, 8
# logical 0 thrice (on both ranks), 3 and 5 twice
PLACED = epx.Placement([0, 1, 2, 3, 0, 4, 5, 6, 7, 0, 3, 5], num_ranks=W_)


def routing_of(rank):
    rng = np.random.default_rng(SEED * 7 + rank)
    idx = np.stack([rng.choice(E_, K_, replace=False) for _ in range(T_)]).astype(np.int32)
    idx[3, 1] = -1  # a dropped route counts nowhere
    w = rng.random((T_, K_)).astype(np.float32)
    return idx, w


def expected_physical_counts(pl):
    """Routes per physical expert under the round-robin rule: token t of
    rank s to logical e goes to replica (t + s) mod n of e."""
    counts = np.zeros(pl.num_physical, np.int64)
    for s in range(W_):
        idx, _ = routing_of(s)
        for t in range(T_):
            for e in idx[t]:
                if e >= 0:
                    reps = pl.replicas(e)
                    counts[reps[(t + s) % len(reps)]] += 1
    return counts


def test_buffer_counts_routes_and_follows_the_round_robin_rule():
    want = expected_physical_counts(PLACED)

    def rank(comm):
        idx, w = routing_of(comm.rank)
        with comm.buffer(hidden=H_, num_experts=E_, max_top_k=K_, max_tokens_per_rank=T_,
                         placement=PLACED) as buf:
            assert buf.placement is PLACED and buf.experts_per_rank == 6
            h = buf.dispatch_layout(idx, w)
            counts, _ = h.expert_counts()
            x = epx.zeros((T_, H_), np.float32)
            x[:] = np.arange(T_)[:, None] + 1
            out = buf.combine(h, buf.dispatch(h, x))  # identity experts: out = sum_k w * x
            valid = np.where(idx >= 0, w, 0).sum(1)
            assert np.allclose(out, valid[:, None] * x, rtol=1e-6)
            h.release()
            load = buf.expert_load(reset=True)
            assert np.array_equal(load, np.bincount(idx[idx >= 0], minlength=E_))
            assert not buf.expert_load().any()
            return counts
    got = epx.run_local(W_, rank, timeout_seconds=TIMEOUT)
    for r in range(W_):
        assert np.array_equal(got[r], want[PLACED.local_experts(r)])


def test_replica_grad_sum_and_move_are_exact():
    def rank(comm):
        r = comm.rank
        with comm.buffer(hidden=H_, num_experts=E_, max_top_k=K_, max_tokens_per_rank=T_,
                         placement=PLACED) as buf:
            mine = PLACED.local_experts(r)
            grads = epx.empty((6, 3, 5), np.float32)
            grads[:] = (100 * r + mine)[:, None, None] + np.arange(15).reshape(3, 5)
            assert buf.replica_grad_sum(grads) is grads
        # blocks that name their logical expert (and a column), moved and back
        src = epx.empty((E_ // W_, 4), np.float64)
        src[:] = (np.arange(E_ // W_) + r * (E_ // W_))[:, None] * 10 + np.arange(4)
        placed = epx.placement_move(comm, src, None, PLACED)
        back = epx.placement_move(comm, placed, PLACED, None, out=epx.empty(src.shape, src.dtype))
        return mine, grads, placed, np.array_equal(back, src)
    res = epx.run_local(W_, rank, timeout_seconds=TIMEOUT)
    phys_rank = PLACED.ranks(W_)
    for r, (mine, grads, placed, back_ok) in enumerate(res):
        assert back_ok
        for s, p in enumerate(mine):
            e = PLACED.physical_to_logical[p]
            reps = PLACED.replicas(e)
            base = sum(100 * phys_rank[q] + q for q in reps) if len(reps) > 1 else 100 * r + p
            want = base + len(reps if len(reps) > 1 else [p]) * np.arange(15).reshape(3, 5)
            assert np.array_equal(grads[s], want), (r, s)
            assert np.array_equal(placed[s], e * 10 + np.arange(4))


def test_a_refusal_in_python_fails_the_peers_at_once():
    """A rank whose arguments Python refuses still meets its peers in the
    library's agreement: they fail with PeerFailedError, not a timeout."""
    def rank(comm):
        src = epx.zeros((E_ // W_ + comm.rank, 2), np.float32)  # rank 1: one row too many
        try:
            epx.placement_move(comm, src, None, PLACED)
        except epx.EpxError as e:
            return type(e).__name__, e.message
    t0 = time.time()
    res = epx.run_local(W_, rank, timeout_seconds=30)
    assert time.time() - t0 < 10
    assert res[0][0] == "PeerFailedError" and "rank 1" in res[0][1]
    assert res[1][0] == "InvalidArgumentError" and "src has shape [5, 2]" in res[1][1]

    def create(comm):  # rank 1: a placement of other experts; refused in Python
        try:
            comm.buffer(hidden=H_, num_experts=E_ + 4 * comm.rank, max_top_k=K_, placement=PLACED)
        except epx.EpxError as e:
            return type(e).__name__, e.message
    t0 = time.time()
    res = epx.run_local(W_, create, timeout_seconds=30)
    assert time.time() - t0 < 10
    assert res[0][0] in ("PeerFailedError", "ShapeMismatchError") and "rank 1" in res[0][1]
    assert res[1][0] == "InvalidArgumentError" and "num_experts is 12" in res[1][1]


def test_errors_name_their_argument():
    P = epx.Placement
    with pytest.raises(ValueError, match="physical_to_logical has dtype float64"):
        P([0.0, 1.0])
    with pytest.raises(ValueError, match=r"physical_to_logical has shape \[2, 2\]"):
        P([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"physical_to_logical\[1\] is 5, outside"):
        P([0, 5, 1], num_experts=3)
    with pytest.raises(ValueError, match="serves no replica of logical expert 1"):
        P([0, 2, 2, 0])
    with pytest.raises(ValueError, match="physical_rank puts 3 physical experts on rank 0"):
        P([0, 1, 2, 3], [0, 0, 0, 1])
    with pytest.raises(ValueError, match="physical_rank has 2 entries; expected 4"):
        P([0, 1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="replica_rule is 7"):
        P([0, 1], replica_rule=7)
    with pytest.raises(ValueError, match="num_ranks is 3; pass a positive divisor"):
        P([0, 1], num_ranks=3)
    with pytest.raises(ValueError, match="num_experts 6 and num_ranks 4"):
        P.contiguous(6, 4)
    load = skewed_load(16)
    bad = load.copy()
    bad[3] = -1
    with pytest.raises(ValueError, match=r"load\[3\] is -1.0"):
        P.plan(bad, 16, 4)
    with pytest.raises(ValueError, match="load has dtype bool"):
        P.plan(np.ones(16, bool), 16, 4)
    with pytest.raises(ValueError, match="num_physical is 19"):  # the library's own check
        P.plan(load, 19, 4)
    pl = P.plan(load, 20, 4)
    with pytest.raises(ValueError, match="load has 8 entries; expected 16"):
        pl.rank_load(load[:8])
    with pytest.raises(ValueError, match="num_ranks is 2 but the placement is over 4 ranks"):
        pl.skew(load, num_ranks=2)

    def rank(comm):
        with pytest.raises(ValueError, match="placement is a list"):
            comm.buffer(hidden=8, num_experts=16, max_top_k=2, placement=[0, 1])
        with pytest.raises(ValueError, match="placement serves 16 logical experts but "
                                             "num_experts is 8"):
            comm.buffer(hidden=8, num_experts=8, max_top_k=2, placement=pl)
        with comm.buffer(hidden=8, num_experts=16, max_top_k=2, placement=pl) as buf:
            with pytest.raises(ValueError, match=r"grads has shape \[4, 3\]; expected \[20, 3\]"):
                buf.replica_grad_sum(epx.zeros((4, 3)))
            with pytest.raises(ValueError, match="grads has dtype float64"):
                buf.replica_grad_sum(epx.zeros((20, 3), np.float64))
            with pytest.raises(ValueError, match="grads is not C-contiguous"):
                buf.replica_grad_sum(epx.zeros((20, 6))[:, ::2])
        src = epx.zeros((4, 2), np.float64)
        with pytest.raises(ValueError, match="old and new are both None"):
            epx.placement_move(comm, src, None, None)
        with pytest.raises(ValueError, match="new is a dict"):
            epx.placement_move(comm, src, None, {})
        with pytest.raises(ValueError, match="out overlaps src"):
            epx.placement_move(comm, src, None, P.contiguous(4, 1), out=src)
        with pytest.raises(ValueError, match=r"out is float32 \[4, 2\]; expected float64"):
            epx.placement_move(comm, src, None, None, num_experts=4, out=epx.zeros((4, 2)))
        return True
    with epx.Comm.create_self() as self_comm:
        # pl is over 4 ranks: a 1-rank comm is refused naming it
        with pytest.raises(ValueError, match="placement is over 4 ranks but the comm has 1"):
            self_comm.buffer(hidden=8, num_experts=16, max_top_k=2, placement=pl)
    pl = P.plan(load, 20, 1)
    assert epx.run_local(1, rank) == [True]


# ---------------------------------------------------------------------------
# The torch layer under a placement
# ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
import epx.torch as et  # noqa: E402

torch.set_num_threads(1)
TH, TF, TE, TK, TT = 16, 8, 8, 2, 24


def weights(seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return dict(router=torch.randn(TE, TH, generator=g),
                w1=torch.randn(TE, 2 * TF, TH, generator=g) * TH ** -0.5,
                w2=torch.randn(TE, TH, TF, generator=g) * TF ** -0.5,
                x=[torch.randn(TT, TH, generator=g) for _ in range(4)],
                g=[torch.randn(TT, TH, generator=g) for _ in range(4)])


def layer(comm, wt, placement=None, dtype=torch.float32):
    m = et.MoE(comm, TH, TF, TE, TK, max_tokens_per_rank=TT, placement=placement, dtype=dtype)
    logical = (placement.local_logical(comm.rank, comm.size) if placement is not None else
               np.arange(TE // comm.size) + comm.rank * (TE // comm.size))
    with torch.no_grad():
        m.router.weight.copy_(wt["router"])
        m.w_gate_up.copy_(wt["w1"][list(logical)].to(dtype))
        m.w_down.copy_(wt["w2"][list(logical)].to(dtype))
    return m


def step(comm, wt, placement):
    m = layer(comm, wt, placement)
    x = wt["x"][comm.rank].clone().requires_grad_(True)
    out = m(x)
    ((out * wt["g"][comm.rank]).sum() + m.aux_loss).backward()
    before = m.w_gate_up.grad.clone()
    et.replica_grad_sum(m)
    res = dict(out=out.detach(), grad_x=x.grad, router=m.router.weight.grad,
               w1=m.w_gate_up.grad.clone(), w2=m.w_down.grad.clone(), before=before,
               load=m.buffer.expert_load())
    m.buffer.close()
    return res


@pytest.mark.parametrize("W", [2, 4])
def test_replicated_layer_matches_the_contiguous_layer(W):
    """The same expert weights under the contiguous map and under a plan
    with replicas: the same outputs and input/router gradients (the combine
    order may differ in the last place), and after replica_grad_sum each
    replica's weight gradient is the contiguous layer's, identical in every
    replica."""
    wt = weights()
    base = epx.run_local(W, step, wt, None, timeout_seconds=TIMEOUT)
    load = sum(r["load"] for r in base)
    placement = epx.Placement.plan(load, TE + W, W)  # one redundant expert per rank
    assert placement.num_physical > placement.num_experts
    got = epx.run_local(W, step, wt, placement, timeout_seconds=TIMEOUT)
    tol = dict(rtol=1e-5, atol=1e-6)
    El = TE // W
    full = {k: torch.cat([r[k] for r in base]) for k in ("w1", "w2")}  # [E, ...] by logical id
    router = sum(r["router"] for r in base)
    assert router.abs().max() > 0
    torch.testing.assert_close(sum(r["router"] for r in got), router, **tol)
    seen = {}
    summed = False
    for r in range(W):
        torch.testing.assert_close(got[r]["out"], base[r]["out"], **tol)
        torch.testing.assert_close(got[r]["grad_x"], base[r]["grad_x"], **tol)
        assert np.array_equal(got[r]["load"], base[r]["load"])  # logical counts: the same routes
        for s, e in enumerate(placement.local_logical(r)):
            for k in ("w1", "w2"):
                torch.testing.assert_close(got[r][k][s], full[k][e], **tol)
                if e in seen.get(k, {}):
                    assert torch.equal(got[r][k][s], seen[k][e]), "replicas of %d differ" % e
                seen.setdefault(k, {})[e] = got[r][k][s]
            if len(placement.replicas(e)) > 1:
                summed |= not torch.equal(got[r]["before"][s], got[r]["w1"][s])
    assert summed  # the sum was needed: a replica alone has part of the gradient
    assert len(seen["w1"]) == TE and El * W == TE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_experts_there_and_back_is_exact(dtype):
    wt = weights(SEED + 1)
    W = 2
    placement = epx.Placement([0, 1, 2, 3, 0, 4, 5, 6, 7, 0], num_ranks=W)

    def rank(comm):
        m = layer(comm, wt, None, dtype)
        w1, w2 = m.w_gate_up, m.w_down
        orig = (w1.detach().clone(), w2.detach().clone())
        x = wt["x"][comm.rank].to(dtype)
        before = m(x).detach()
        m.aux_loss = None
        assert et.move_experts(m, placement) is m
        assert m.w_gate_up is w1 and m.w_down is w2  # the same parameters, new data
        assert m.placement is placement and m.num_local_experts == 5
        assert m.buffer.placement is placement and m.buffer.experts_per_rank == 5
        for s, e in enumerate(placement.local_logical(comm.rank)):
            assert torch.equal(w1[s], wt["w1"][e].to(dtype))
            assert torch.equal(w2[s], wt["w2"][e].to(dtype))
        torch.testing.assert_close(m(x).detach().float(), before.float(), rtol=1e-2 if dtype ==
                                   torch.bfloat16 else 1e-5, atol=1e-2 if dtype ==
                                   torch.bfloat16 else 1e-6)
        m.aux_loss = None
        # the measured load plans the same placement on every rank
        plan = et.plan_placement(m, TE + 2)
        et.move_experts(m, None)
        assert m.placement is None and m.num_local_experts == TE // W
        assert torch.equal(w1, orig[0]) and torch.equal(w2, orig[1])
        m.buffer.close()
        return plan
    plans = epx.run_local(W, rank, timeout_seconds=TIMEOUT)
    assert plans[0] == plans[1]


def test_layer_errors_name_their_argument():
    pl = epx.Placement([0, 1, 2, 3, 0, 1], replica_rule=epx.ReplicaRule.CALLER)

    def rank(comm):
        with pytest.raises(ValueError, match="placement.replica_rule is CALLER"):
            et.MoE(comm, TH, TF, 4, 2, max_tokens_per_rank=8, placement=pl)
        with pytest.raises(ValueError, match="placement is a list"):
            et.MoE(comm, TH, TF, 4, 2, max_tokens_per_rank=8, placement=[0, 1, 2, 3])
        with pytest.raises(ValueError, match="num_experts 3 is not a multiple"):
            et.MoE(comm, TH, TF, 3, 2, max_tokens_per_rank=8)
        m = et.MoE(comm, TH, TF, 4, 2, max_tokens_per_rank=8)
        with pytest.raises(ValueError, match="module_or_buffer is a int"):
            et.replica_grad_sum(3)
        with pytest.raises(ValueError, match=r"params\[1\] has shape \[3\]"):
            et.replica_grad_sum(m, [m.w_gate_up, torch.zeros(3)])
        with pytest.raises(ValueError, match="params is None with a buffer"):
            et.replica_grad_sum(m.buffer)
        with pytest.raises(ValueError, match="placement is a str"):
            et.move_experts(m, "balanced")
        with pytest.raises(NotImplementedError, match=r"params\[0\] is on meta"):
            et.replica_grad_sum(m, [torch.zeros(2, 3, device="meta")])
        with pytest.raises(NotImplementedError, match="the layer's w_gate_up is on meta.*CUDA"):
            m.w_gate_up = torch.nn.Parameter(torch.zeros(2, 2 * TF, TH, device="meta"))
            et.move_experts(m, None)
        m.buffer.close()
        return True
    assert epx.run_local(2, rank, timeout_seconds=TIMEOUT) == [True, True]
