"""epx.megatron against Megatron-core's MoEAlltoAllTokenDispatcher (the
megatron-core package, on the CPU): the same routing through both gives the
same permuted tokens in the same order, the same tokens_per_expert and
permuted_probs, the same output and the same gradients. One rank in this
process (a gloo group of one); 2 processes under torchrun (expert parallel 2)
and 4 (expert tensor parallel 2 x expert parallel 2). Skips when megatron-core
is not installed.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_megatron.py
"""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core does not import (pip install "
                    "megatron-core; `make pyenv` does)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import epx  # noqa: E402
import epx.megatron as em  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe import token_dispatcher as mtd  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

torch.set_num_threads(1)


# Megatron on the CPU: the documented helper (a test of its own below).
megatron_on_cpu = em.cpu_shim


def config(E, K, H, drop=0.0, **kw):
    """The layer's TransformerConfig. A routing with dropped routes (fewer
    than K a token, as capacity drops leave) is declared through
    moe_expert_capacity_factor: from megatron-core 0.19 the all-to-all
    dispatcher takes a dropless routing to give exactly T * K rows (no
    count sync), and splits its rows by that."""
    if drop:
        kw.setdefault("moe_expert_capacity_factor", 1.0)
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                             num_moe_experts=E, moe_router_topk=K, use_cpu_initialization=True,
                             moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=True,
                             **kw)


def problem(seed, T, H, E, K, drop=0.0, dtype=torch.float32):
    """hidden [T, H], router logits [T, E], routing_map with K experts per
    token (a fraction `drop` of the routes removed, as capacity drops do),
    expert weights [E, H, H] and the output's gradient; the float32 router,
    the rest in dtype."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    top = torch.topk(logits, K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    if drop:
        routing_map &= torch.rand(T, E, generator=g) >= drop
    weights = torch.randn(E, H, H, generator=g) / H ** 0.5
    grad = torch.randn(T, H, generator=g)
    return hidden.to(dtype), logits, routing_map, weights.to(dtype), grad.to(dtype)


def step(disp, hidden, logits, routing_map, weights, grad):
    """One forward and backward through the six methods, the experts
    applying permuted_probs as Megatron's do."""
    hidden = hidden.clone().requires_grad_(True)
    logits = logits.clone().requires_grad_(True)
    probs = torch.softmax(logits, dim=1) * routing_map
    x, p = disp.dispatch_preprocess(hidden, routing_map, probs)
    x, p = disp.token_dispatch(x, p)
    tokens, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(x, p)
    outs = [torch.tanh(chunk @ weights[e]) for e, chunk in
            zip(disp.local_expert_indices, torch.split(tokens, tokens_per_expert.tolist()))]
    expert_out = torch.cat(outs) * permuted_probs[:, None].to(tokens.dtype)
    y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(expert_out)))
    (y * grad).sum().backward()
    return dict(tokens=tokens.detach(), tokens_per_expert=tokens_per_expert,
                probs=permuted_probs.detach(), out=y.detach(), grad_hidden=hidden.grad,
                grad_logits=logits.grad)


def compare(ours, theirs, what=""):
    assert ours["tokens_per_expert"].dtype == torch.int64
    assert ours["tokens_per_expert"].device.type == "cpu"
    assert torch.equal(ours["tokens_per_expert"], theirs["tokens_per_expert"]), what
    # The permutation moves rows: bit for bit.
    assert torch.equal(ours["tokens"], theirs["tokens"]), what
    assert torch.equal(ours["probs"], theirs["probs"]), what
    tol = 1e-6 if ours["out"].dtype == torch.float32 else 1e-2
    for k in ("out", "grad_hidden", "grad_logits"):
        torch.testing.assert_close(
            ours[k], theirs[k], atol=tol, rtol=tol,
            msg=lambda m: "%s %s: %s [EPX_TEST_SEED=%d]" % (what, k, m, SEED))


def both(cfg, pgs, data):
    """The step through Megatron's all-to-all dispatcher and through epx's."""
    ep_rank = pgs.ep.rank()
    El = cfg.num_moe_experts // pgs.ep.size()
    local = list(range(ep_rank * El, (ep_rank + 1) * El))
    with megatron_on_cpu():
        theirs = step(mtd.MoEAlltoAllTokenDispatcher(El, local, cfg, pgs), *data)
        ours_disp = em.EpxTokenDispatcher(El, local, cfg, pgs, timeout_seconds=TIMEOUT)
        ours = step(ours_disp, *data)
    ours_disp.close()
    return ours, theirs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """torch.distributed and Megatron's parallel state over a gloo group of one."""
    import torch.distributed as dist
    store = tmp_path_factory.mktemp("megatron") / "store"
    dist.init_process_group("gloo", init_method="file://%s" % store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield ProcessGroupCollection.use_mpu_process_groups()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("E,K,drop", [(8, 2, 0.0), (6, 3, 0.0), (8, 2, 0.3), (4, 1, 0.0),
                                      (1, 1, 0.0)])
def test_matches_megatrons_alltoall_dispatcher(one_rank, E, K, drop):
    data = problem(SEED + E + K, T=12, H=16, E=E, K=K, drop=drop)
    ours, theirs = both(config(E, K, 16, drop), one_rank, data)
    compare(ours, theirs)


def test_bfloat16_tokens_float32_probs(one_rank):
    data = problem(SEED, T=16, H=16, E=8, K=2, drop=0.2, dtype=torch.bfloat16)
    ours, theirs = both(config(8, 2, 16, 0.2, params_dtype=torch.bfloat16, bf16=True), one_rank,
                        data)
    assert ours["tokens"].dtype == torch.bfloat16 and ours["probs"].dtype == torch.float32
    compare(ours, theirs)


def test_install_replaces_every_moe_layers_dispatcher(one_rank):
    """epx.megatron.install on a model holding a Megatron MoELayer: the layer's
    forward and backward give what they gave with its own dispatcher."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    E, K, H = 4, 2, 16
    cfg = config(E, K, H, ffn_hidden_size=32, moe_ffn_hidden_size=32, add_bias_linear=False)
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    torch.manual_seed(SEED)
    with megatron_on_cpu():
        layer = MoELayer(cfg, MoESubmodules(experts=experts, router=TopKRouter),
                         pg_collection=one_rank)
    model = torch.nn.Sequential(layer)
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(SEED))

    def run():
        layer.zero_grad()
        xx = x.clone().requires_grad_(True)
        out, bias = model(xx)
        (out * torch.cos(torch.arange(H).float())).sum().backward()
        return out.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    with megatron_on_cpu():
        theirs = run()
        made = em.install(model, timeout_seconds=TIMEOUT)
        assert len(made) == 1 and layer.token_dispatcher is made[0]
        assert isinstance(layer.token_dispatcher, em.EpxTokenDispatcher)
        ours = run()
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=1e-5)
    assert ours[2].keys() == theirs[2].keys()
    for name in ours[2]:
        torch.testing.assert_close(ours[2][name], theirs[2][name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m: "%s: %s" % (name, m))
    made[0].close()
    made[0].comm.close()


def moe_layer(cfg, pgs):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return MoELayer(cfg, MoESubmodules(experts=experts, router=TopKRouter), pg_collection=pgs)


def test_cpu_shim_builds_and_runs_a_moe_layer_on_the_cpu(one_rank):
    """epx.megatron.cpu_shim: Megatron's MoE layer builds and runs on a CPU
    inside it (without it, building fails), and torch.cuda is itself again
    after it."""
    cfg = config(4, 2, 16, ffn_hidden_size=32, moe_ffn_hidden_size=32, add_bias_linear=False)
    current_device = torch.cuda.current_device
    if not torch.cuda.is_available():
        with pytest.raises(Exception):
            moe_layer(cfg, one_rank)
    with em.cpu_shim():
        layer = moe_layer(cfg, one_rank)
        made = em.install(layer, timeout_seconds=TIMEOUT)
        out, _ = layer(torch.randn(3, 4, 16))
        out.sum().backward()
    assert out.shape == (3, 4, 16) and torch.cuda.current_device is current_device
    made[0].close()
    made[0].comm.close()


def test_install_without_a_moe_layer_warns(one_rank):
    with pytest.warns(UserWarning, match=r"install: Sequential holds no Megatron MoE layer"):
        assert em.install(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []


def test_a_larger_step_grows_the_buffer(one_rank):
    """The dispatcher's buffer was sized by the first step (an empty one: 0
    tokens, every later step refused); it now grows, and matches Megatron's
    own dispatcher at every size. A fixed max_tokens_per_rank refuses more,
    naming the dispatcher's setting."""
    E = K = 2
    pgs, El = one_rank, 2
    cfg = config(E, K, 16)
    ours = em.EpxTokenDispatcher(El, range(El), cfg, pgs, timeout_seconds=TIMEOUT)
    with megatron_on_cpu():
        for T in (0, 6, 30, 4):
            data = problem(SEED + T, T=T, H=16, E=E, K=K)
            theirs = step(mtd.MoEAlltoAllTokenDispatcher(El, list(range(El)), cfg, pgs), *data)
            compare(step(ours, *data), theirs)
    assert ours.buffer.dropin_max_tokens >= 30
    ours.close()
    fixed = em.EpxTokenDispatcher(El, range(El), cfg, pgs, max_tokens_per_rank=6)
    with megatron_on_cpu():
        step(fixed, *problem(SEED, T=6, H=16, E=E, K=K))
        with pytest.raises(epx.CapacityExceededError, match=r"pass max_tokens_per_rank=7 \(or "
                           r"more\) to EpxTokenDispatcher or epx.megatron.install\(\)"):
            step(fixed, *problem(SEED, T=7, H=16, E=E, K=K))
    fixed.close()


def test_refusals_name_the_setting(one_rank):
    El = 4
    with pytest.raises(epx.UnsupportedError, match="moe_pad_expert_input_to_capacity"):
        em.EpxTokenDispatcher(El, range(El), config(4, 2, 16, moe_expert_capacity_factor=1.0,
                                                    moe_pad_expert_input_to_capacity=True),
                              one_rank)
    with pytest.raises(epx.InvalidArgumentError, match="local_expert_indices"):
        em.EpxTokenDispatcher(2, [1, 2], config(2, 1, 16), one_rank)
    disp = em.EpxTokenDispatcher(El, range(El), config(4, 2, 16), one_rank)
    hidden, logits, _, _, _ = problem(SEED, T=5, H=16, E=4, K=2)
    too_many = torch.ones(5, 4, dtype=torch.bool)
    with pytest.raises(epx.InvalidArgumentError, match="selects 4 experts, more than"):
        disp.dispatch_preprocess(hidden, too_many, torch.softmax(logits, 1))
    with pytest.raises(epx.InvalidArgumentError, match="bool"):
        disp.dispatch_preprocess(hidden, too_many.float(), torch.softmax(logits, 1))
    disp.close()


# ---------------------------------------------------------------------------
# 2 and 4 processes under torchrun (expert parallel 2; expert TP 2 x EP 2)
# ---------------------------------------------------------------------------


def torchrun_worker(seed, tp):
    """One rank: both dispatchers on the same routing, compared here."""
    import torch.distributed as dist
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=W // tp,
        expert_tensor_parallel_size=tp)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    E, K = 8, 2
    for T, drop in ((12, 0.0), (9, 0.25)):
        data = problem(seed + rank, T=T, H=16, E=E, K=K, drop=drop)
        cfg = config(E, K, 16, drop, tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp,
                     expert_model_parallel_size=W // tp, sequence_parallel=tp > 1,
                     add_bias_linear=False)
        ours, theirs = both(cfg, pgs, data)
        compare(ours, theirs, "rank %d T %d" % (rank, T))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("rank %d OK" % rank)


@pytest.mark.parametrize("W,tp", [(2, 1), (4, 2)], ids=["ep2", "etp2xep2"])
def test_ranks_match_megatron_under_torchrun(W, tp):
    torchrun(W, __file__, "torchrun-worker", str(SEED), str(tp))


# A placement changed mid-training (issue 37): the moved layer's next step
# equals a fresh layer's on the new placement with the same weights
# ---------------------------------------------------------------------------


def expert_weights(layer, placement, rank, W, weights=None):
    """{logical: {name: tensor}} of the layer's local experts under
    placement; with `weights`, sets them from it first."""
    E = layer.config.num_moe_experts
    logical = epx.torch.elastic.local_logical(placement, E, rank, W)
    out = {}
    with torch.no_grad():
        for module, e in zip(layer.experts.local_experts, logical):
            for name, p in module.named_parameters():
                if weights is not None:
                    p.copy_(weights[e][name])
            out[e] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


def layer_step(layer, x, g):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def placement_worker(seed):
    import torch.distributed as dist
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=W)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    E, K, H = 4, 2, 16
    cfg = config(E, K, H, ffn_hidden_size=24, moe_ffn_hidden_size=24, add_bias_linear=False,
                 expert_model_parallel_size=W)
    new = epx.Placement([3, 0, 1, 2])  # rank 0: logical 3, 0; rank 1: 1, 2
    with em.cpu_shim():
        torch.manual_seed(seed)
        moved = moe_layer(cfg, pgs)
        em.install(moved, timeout_seconds=TIMEOUT)
        g = torch.Generator().manual_seed(seed + 1 + rank)
        x, dy = torch.randn(3, 4, H, generator=g), torch.randn(3, 4, H, generator=g)
        layer_step(moved, x, dy)  # a training step on the contiguous map
        with torch.no_grad():
            for p in moved.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        parts = [None] * W
        dist.all_gather_object(parts, expert_weights(moved, None, rank, W))
        trained = {e: w for part in parts for e, w in part.items()}
        em.move_placement(moved, new)
        for e, w in expert_weights(moved, new, rank, W).items():
            for n, t in w.items():
                assert torch.equal(t, trained[e][n]), "rank %d: expert %d %s not moved" % (rank, e, n)
        torch.manual_seed(seed + 99)
        fresh = moe_layer(cfg, pgs)
        em.install(fresh, timeout_seconds=TIMEOUT, placement=new)
        fresh.router.weight.data.copy_(moved.router.weight.data)
        expert_weights(fresh, new, rank, W, trained)
        x2, dy2 = torch.randn(3, 4, H, generator=g), torch.randn(3, 4, H, generator=g)
        ours, theirs = layer_step(moved, x2, dy2), layer_step(fresh, x2, dy2)
        what = "rank %d after the move [EPX_TEST_SEED=%d]" % (rank, seed)
        torch.testing.assert_close(ours[0], theirs[0], atol=0, rtol=0, msg=lambda m: what + " out: " + m)
        torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0, msg=lambda m: what + " x grad: " + m)
        assert ours[2].keys() == theirs[2].keys(), what
        for name, grad in ours[2].items():
            torch.testing.assert_close(grad, theirs[2][name], atol=0, rtol=0,
                                       msg=lambda m: "%s %s: %s" % (what, name, m))
        # The placement is honoured: a layer on the contiguous map with the
        # same logical experts computes the same (up to the sum's order).
        ref = moe_layer(cfg, pgs)
        em.install(ref, timeout_seconds=TIMEOUT)
        ref.router.weight.data.copy_(moved.router.weight.data)
        expert_weights(ref, None, rank, W, trained)
        contiguous = layer_step(ref, x2, dy2)
        for i, name in ((0, "out"), (1, "x grad")):
            torch.testing.assert_close(ours[i], contiguous[i], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: "%s %s vs the contiguous map: %s" % (what, name, m))
        ref.token_dispatcher.close()
        ref.token_dispatcher.comm.close()
        with pytest.raises(epx.UnsupportedError, match="replicas"):
            em.move_placement(moved, epx.Placement([0, 1, 2, 3, 0, 1], num_ranks=W))
        for layer in (moved, fresh):
            layer.token_dispatcher.close()
            layer.token_dispatcher.comm.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("rank %d OK" % rank)


def test_placement_moved_mid_training_matches_a_fresh_layer():
    torchrun(2, __file__, "placement-worker", str(SEED))


if __name__ == "__main__" and sys.argv[1:2] == ["torchrun-worker"]:
    torchrun_worker(int(sys.argv[2]), int(sys.argv[3]))
if __name__ == "__main__" and sys.argv[1:2] == ["placement-worker"]:
    placement_worker(int(sys.argv[2]))
