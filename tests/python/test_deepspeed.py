"""epx.deepspeed.MoE against deepspeed.moe.layer.MoE (the deepspeed package,
on the CPU): loaded with DeepSpeed's own state dict, the same input gives the
same output, l_aux and exp_counts, and the same gradients of the input, the
gate and every expert parameter; top-1, top-2 and top-k gating, with and
without the capacity drop, training and eval capacity. The expert
parameters carry DeepSpeed's tags. One rank in this process; 2 processes
(ep_size 2) under torchrun. Skips when deepspeed is not installed.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_deepspeed.py
"""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on a machine without a GPU
pytest.importorskip("deepspeed", reason="deepspeed does not import (DS_BUILD_OPS=0 pip install "
                    "deepspeed; `make pyenv` does)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import deepspeed  # noqa: E402
import deepspeed.moe.layer as dsl  # noqa: E402

import epx  # noqa: E402
import epx.deepspeed as eds  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

torch.set_num_threads(1)
H, F_ = 16, 24


def expert():
    return torch.nn.Sequential(torch.nn.Linear(H, F_), torch.nn.GELU(), torch.nn.Linear(F_, H))


def pair(seed, E, k, ep_size=1, **kw):
    """DeepSpeed's layer and epx's, the second loaded with the first's state dict."""
    torch.manual_seed(seed)
    args = dict(num_experts=E, ep_size=ep_size, k=k, use_rts=False, min_capacity=2,
                top2_2nd_expert_sampling=False, **kw)
    theirs = dsl.MoE(H, expert(), **args)
    ours = eds.MoE(H, expert(), timeout_seconds=TIMEOUT, **args)
    missing = ours.load_state_dict(theirs.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    return theirs, ours


def step(layer, x, g, train=True):
    layer.train(train)
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out, l_aux, exp_counts = layer(x)
    ((out * g).sum() + 0.1 * l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return dict(out=out.detach(), l_aux=l_aux.detach(), exp_counts=exp_counts, x=x.grad,
                grads=grads)


def compare(ours, theirs, what):
    assert ours["exp_counts"].dtype == torch.int64, what
    assert torch.equal(ours["exp_counts"], theirs["exp_counts"]), what
    msg = "%s [EPX_TEST_SEED=%d]" % (what, SEED)
    for k in ("out", "l_aux", "x"):
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: "%s %s: %s" % (msg, k, m))
    assert ours["grads"].keys() == theirs["grads"].keys(), msg
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, theirs["grads"][name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: "%s %s: %s" % (msg, name, m))


def inputs(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, H, generator=g), torch.randn(*shape, H, generator=g)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """deepspeed.comm over a gloo group of one (DeepSpeed's gates ask it)."""
    import torch.distributed as dist
    store = tmp_path_factory.mktemp("deepspeed") / "store"
    dist.init_process_group("gloo", init_method="file://%s" % store, rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()


CASES = [  # E, k, capacity_factor, drop_tokens
    (4, 1, 4.0, True), (4, 1, 1.0, True), (4, 1, 1.0, False), (8, 2, 1.0, True), (8, 2, 0.5, True),
    (8, 2, 1.0, False), (8, 3, 1.0, True), (6, 4, 0.75, True), (8, 3, 1.0, False)]


@pytest.mark.parametrize("E,k,factor,drop", CASES)
def test_matches_deepspeeds_moe(one_rank, E, k, factor, drop):
    theirs, ours = pair(SEED, E, k, capacity_factor=factor, eval_capacity_factor=factor / 2,
                        drop_tokens=drop)
    x, g = inputs(SEED + 1, (3, 10))
    for train in (True, False):
        compare(step(ours, x, g, train), step(theirs, x, g, train), "train=%s" % train)
    ours.close()


def over_capacity_inputs(ours, E, T, seed):
    """x [T, H] whose top-1 choice is expert 0 for most tokens (the gate's
    row 0 pushed along a direction every token shares): an expert over
    capacity at capacity factor 1.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) + 2.0
    with torch.no_grad():
        ours.deepspeed_moe.gate.wg.weight[0] += 0.15
    return x, torch.randn(T, H, generator=g)


@pytest.mark.parametrize("E,T", [(4, 24), (8, 40), (2, 64)])
def test_top1_drops_the_routes_deepspeed_drops(one_rank, E, T):
    """k=1, drop_tokens, use_rts=False, an expert over capacity: DeepSpeed
    keeps the C tokens torch.topk returns among the tied 0/1 mask values
    (not the first C); the drop-in keeps the same ones: same outputs, same
    gradients."""
    theirs, ours = pair(SEED, E, 1, capacity_factor=1.0, eval_capacity_factor=1.0,
                        drop_tokens=True)
    x, g = over_capacity_inputs(ours, E, T, SEED + 3)
    theirs.load_state_dict(ours.state_dict())
    for train in (True, False):
        res = step(theirs, x, g, train)
        assert int(res["exp_counts"].max()) > -(-T // E), "no expert over capacity"
        compare(step(ours, x, g, train), res, "E %d T %d train=%s" % (E, T, train))
    ours.close()


def test_a_larger_batch_grows_the_buffer(one_rank):
    """The buffer was sized by the first batch and a larger one refused; it
    now grows (max_tokens_per_rank left None), and the outputs stay
    DeepSpeed's. A fixed max_tokens_per_rank refuses more, naming it."""
    theirs, ours = pair(SEED, 4, 2, capacity_factor=4.0)
    for i, T in enumerate((4, 40, 8)):
        x, g = inputs(SEED + 4 + i, (T,))
        compare(step(ours, x, g), step(theirs, x, g), "T %d" % T)
    assert ours.deepspeed_moe.buffer.dropin_max_tokens >= 40
    ours.close()
    fixed = eds.MoE(H, expert(), num_experts=4, k=2, top2_2nd_expert_sampling=False,
                    max_tokens_per_rank=8)
    fixed(torch.randn(8, H))
    with pytest.raises(epx.CapacityExceededError, match=r"pass max_tokens_per_rank=9 \(or more\) "
                       r"to epx.deepspeed.MoE"):
        fixed(torch.randn(9, H))
    fixed.close()


def test_residual_moe(one_rank):
    """use_residual: DeepSpeed's MoE.forward mixes the MoE output with the
    dense expert's, around epx's layer."""
    theirs, ours = pair(SEED, 4, 2, use_residual=True)
    x, g = inputs(SEED + 2, (16,))
    compare(step(ours, x, g), step(theirs, x, g), "use_residual")
    ours.close()


def test_expert_parameters_are_tagged_as_deepspeed_tags_them(one_rank):
    theirs, ours = pair(SEED, 4, 1)
    assert isinstance(ours, dsl.MoE)
    tagged = {n: (p.allreduce, p.group_name) for n, p in ours.named_parameters()
              if hasattr(p, "allreduce")}
    assert tagged == {n: (p.allreduce, p.group_name) for n, p in theirs.named_parameters()
                      if hasattr(p, "allreduce")}
    assert len(tagged) == 4 * 4 and set(tagged.values()) == {(False, "ep_size_1")}
    assert not hasattr(ours.deepspeed_moe.gate.wg.weight, "allreduce")


def test_refusals_name_the_fix(one_rank):
    with pytest.raises(epx.UnsupportedError, match="top2_2nd_expert_sampling=False"):
        eds.MoE(H, expert(), num_experts=4, k=2)
    with pytest.raises(epx.UnsupportedError, match="noisy_gate_policy"):
        eds.MoE(H, expert(), num_experts=4, noisy_gate_policy="Jitter")
    layer = eds.MoE(H, expert(), num_experts=4, ep_size=2)
    with pytest.raises(epx.InvalidArgumentError, match="set_deepspeed_parallelism"):
        layer(torch.randn(8, H))


def test_rts_keeps_capacity_routes(one_rank):
    """use_rts=True: top-1 keeps C routes of an over-full expert, chosen by a
    seeded priority."""
    torch.manual_seed(SEED)
    layer = eds.MoE(H, expert(), num_experts=2, k=1, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(40, H)
    with torch.no_grad():
        out, l_aux, counts = layer(x)
    kept = (out.detach().abs().sum(1) > 0).sum()
    C = 10  # ceil(40 / 2 * 0.5)
    assert int(counts.sum()) == 40 and int(kept) == sum(min(int(c), C) for c in counts)
    layer.close()


# ---------------------------------------------------------------------------
# 2 processes under torchrun: ep_size 2
# ---------------------------------------------------------------------------


def torchrun_worker(seed):
    import torch.distributed as dist
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    for E, k, factor, drop in ((4, 1, 4.0, True), (8, 2, 0.5, True), (8, 3, 1.0, True)):
        theirs, ours = pair(seed, E, k, ep_size=W, capacity_factor=factor, drop_tokens=drop)
        for layer in (theirs, ours):
            layer.set_deepspeed_parallelism()
        x, g = inputs(seed + 1 + rank, (2, 12))
        compare(step(ours, x, g), step(theirs, x, g), "rank %d E %d k %d" % (rank, E, k))
        ours.close()
    dist.destroy_process_group()
    print("rank %d OK" % rank)


def test_two_ranks_match_deepspeed_under_torchrun():
    torchrun(2, __file__, "torchrun-worker", str(SEED))


# ---------------------------------------------------------------------------
# A placement changed mid-training (issue 37): the moved layer's next step
# equals a fresh layer's on the new placement with the same weights
# ---------------------------------------------------------------------------


def set_distinct_experts(layer, placement, rank, weights=None):
    """Local expert i gets logical expert local_logical(rank)[i]'s weights:
    from `weights` ({logical: {name: tensor}}) or made from its id."""
    W = layer.deepspeed_moe.ep_size
    logical = epx.torch.elastic.local_logical(placement, layer.num_experts, rank, W)
    with torch.no_grad():
        for module, e in zip(layer.deepspeed_moe.experts.deepspeed_experts, logical):
            g = torch.Generator().manual_seed(1000 + e)
            for name, p in module.named_parameters():
                p.copy_(weights[e][name] if weights else torch.randn(p.shape, generator=g) * 0.3)


def local_weights(layer, placement, rank):
    W = layer.deepspeed_moe.ep_size
    logical = epx.torch.elastic.local_logical(placement, layer.num_experts, rank, W)
    return {e: {n: p.detach().clone() for n, p in m.named_parameters()}
            for m, e in zip(layer.deepspeed_moe.experts.deepspeed_experts, logical)}


def placement_worker(seed):
    import torch.distributed as dist
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    E, k = 4, 2
    args = dict(num_experts=E, ep_size=W, k=k, use_rts=False, min_capacity=2, drop_tokens=False,
                top2_2nd_expert_sampling=False, timeout_seconds=TIMEOUT)
    new = epx.Placement([3, 0, 1, 2])  # rank 0: logical 3, 0; rank 1: 1, 2
    torch.manual_seed(seed)
    moved = eds.MoE(H, expert(), **args)
    moved.set_deepspeed_parallelism()
    set_distinct_experts(moved, None, rank)
    # A training step on the contiguous map, then the move.
    x, g = inputs(seed + 1 + rank, (2, 12))
    step(moved, x, g)
    with torch.no_grad():
        for p in moved.parameters():
            p -= 0.1 * p.grad
    trained = {}
    gathered = [None] * W
    dist.all_gather_object(gathered, local_weights(moved, None, rank))
    for part in gathered:
        trained.update(part)
    moved.move_placement(new)
    assert moved.deepspeed_moe.placement == new
    # A fresh layer on the new placement with the trained weights.
    fresh = eds.MoE(H, expert(), placement=new, **args)
    fresh.set_deepspeed_parallelism()
    fresh.deepspeed_moe.gate.wg.weight.data.copy_(moved.deepspeed_moe.gate.wg.weight.data)
    set_distinct_experts(fresh, new, rank, trained)
    for name, p in local_weights(moved, new, rank).items():
        for n, t in p.items():
            assert torch.equal(t, trained[name][n]), "rank %d: expert %d %s not moved" % (rank, name, n)
    x2, g2 = inputs(seed + 7 + rank, (2, 12))
    ours = step(moved, x2, g2)
    compare(ours, step(fresh, x2, g2), "rank %d after the move" % rank)
    # The placement is honoured: a layer on the contiguous map with the same
    # logical experts computes the same (up to the sum's order).
    ref = eds.MoE(H, expert(), **args)
    ref.set_deepspeed_parallelism()
    ref.deepspeed_moe.gate.wg.weight.data.copy_(moved.deepspeed_moe.gate.wg.weight.data)
    set_distinct_experts(ref, None, rank, trained)
    contiguous = step(ref, x2, g2)
    for key in ("out", "l_aux", "x"):
        torch.testing.assert_close(ours[key], contiguous[key], atol=1e-5, rtol=1e-5)
    ref.close()
    # And back to the contiguous map: the experts are where they started.
    moved.move_placement(None)
    for name, p in local_weights(moved, None, rank).items():
        for n, t in p.items():
            assert torch.equal(t, trained[name][n]), "rank %d: expert %d %s not moved back" % (rank, name, n)
    moved.close()
    fresh.close()
    dist.destroy_process_group()
    print("rank %d OK" % rank)


def test_placement_moved_mid_training_matches_a_fresh_layer():
    torchrun(2, __file__, "placement-worker", str(SEED))


def test_replicas_are_refused_by_name(one_rank):
    with pytest.raises(epx.UnsupportedError, match="replicas"):
        eds.MoE(H, expert(), num_experts=2, k=1, placement=epx.Placement([0, 1, 1]),
                top2_2nd_expert_sampling=False)


if __name__ == "__main__" and sys.argv[1:2] == ["torchrun-worker"]:
    torchrun_worker(int(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:2] == ["placement-worker"]:
    placement_worker(int(sys.argv[2]))
