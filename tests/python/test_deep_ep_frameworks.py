"""The frameworks' own released DeepEP paths, unchanged, with ``import
deep_ep`` resolved to epx.deep_ep (epx.deep_ep.install()), against each
framework's path without DeepEP, on CPU under torchrun (gloo):

- Megatron-core (0.16.1 here): MoEFlexTokenDispatcher with
  moe_flex_dispatcher_backend="deepep" against MoEAlltoAllTokenDispatcher:
  tokens, tokens_per_expert, permuted probs, output and gradients (hidden,
  router logits). The flex dispatcher needs TP x EP > 1: 2 processes.
- DeepSpeed 0.19.8 AutoEP: its AutoEPMoELayer (built from a Mixtral block
  as AutoEP's replacement builds it) with comm_backend="deepep"
  (_deepep_route: DeepEPExchange on deep_ep.ElasticBuffer, deepep_dispatch /
  deepep_combine, DeepEPCheckpointReplay) against the same layer with
  comm_backend="comm" (its all-to-all path): outputs, input and parameter
  gradients; under activation checkpointing the recompute replays the
  forward's handle (no second layout, counted). On CPU one call is patched:
  the barrier with device_ids=[CUDA index] (_cpu_barrier_without_device_ids).
- NeMo Automodel 0.7.0: fused_a2a's fused_dispatch / fused_combine
  (deep_ep.Buffer), with its dispatch-replay recorder under activation
  checkpointing, against the same layer computed without DeepEP: the
  recompute's dispatches exchange no layout (counted).
- NeMo Automodel 0.7.0's own MoE layer (needs transformers): two blocks of
  its MoE (Gate, GroupedExpertsDeepEP on torch._grouped_mm, the flex token
  dispatcher's deepep backend, a shared expert), parallelized by NeMo's
  apply_ep and checkpointed by its apply_ac, against the same weights on its
  torch dispatcher (GroupedExperts: all-gather, all-reduce): outputs, input
  and parameter gradients, float32 and bfloat16; with apply_ac's default
  (ignore_router=True: selective checkpointing plus NeMo's dispatch replay)
  the recompute exchanges no layout, with ignore_router=False one per block
  (counted). 2 processes only: NeMo takes its DeepEP path only at EP world
  size > 1 (MoE falls back to GroupedExperts, apply_ep asserts size > 1).
  One call is patched on CPU: the fused permute (Transformer Engine,
  Triton), to NeMo's own unfused permute (_nemo_unfused_permute).

Each skips where the framework does not import. Run:
EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_deep_ep_frameworks.py
"""
import importlib.util
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

from torchrun_jobs import torchrun  # noqa: E402

# EPX_DEEP_EP_DEVICE=cuda runs the DeepSpeed and NeMo workers on the GPUs
# (bench/gpu/deep_ep_check.sh: NCCL groups, one GPU a process)
DEV = os.environ.get("EPX_DEEP_EP_DEVICE", "cpu")


def _have(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _shared_gpu():
    """More processes on this host than GPUs (world size 2 on one GPU,
    bench/gpu/deep_ep_check.sh): they share them; NCCL refuses two ranks on
    one GPU, so the group is gloo (the frameworks' own collectives on CUDA
    tensors through it) and epx's comm the shm one, its CUDA buffers over
    CUDA IPC (epx.torch.comm_from_process_group)."""
    return DEV == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()


def _backend():
    return "nccl" if DEV == "cuda" and not _shared_gpu() else "gloo"


def _start():
    import torch.distributed as dist
    torch.set_num_threads(1)
    import epx.deep_ep
    epx.deep_ep.install()           # before the frameworks import DeepEP
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(_backend())
    return dist.get_rank(), dist.get_world_size()


def _close(rank):
    import torch.distributed as dist
    dist.barrier()
    print("rank %d OK" % rank, flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Megatron-core: the flex dispatcher's deepep backend
# ---------------------------------------------------------------------------


def megatron_worker():
    rank, W = _start()
    import test_megatron as tm
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import fused_a2a
    from megatron.core.transformer.moe import token_dispatcher as mtd
    import epx.deep_ep as deep_ep
    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is deep_ep.Buffer
    parallel_state.initialize_model_parallel(expert_model_parallel_size=W)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    E, K, H = 8, 2, 16
    El = E // W
    local = list(range(rank * El, (rank + 1) * El))
    rows = []
    for T, drop, dtype in ((12, 0.0, torch.float32), (9, 0.25, torch.float32),
                           (10, 0.0, torch.bfloat16)):
        data = tm.problem(1234 + rank, T=T, H=H, E=E, K=K, drop=drop, dtype=dtype)
        kw = dict(expert_model_parallel_size=W, add_bias_linear=False, moe_router_dtype="fp32")
        # dropped routes (probs 0) declared by moe_expert_capacity_factor on
        # both (tm.config): the flex dispatcher makes them -1, and 0.19's
        # all-to-all dispatcher counts rows instead of assuming T * K
        cfg_a2a = tm.config(E, K, H, drop, **kw)
        cfg_flex = tm.config(E, K, H, drop, **kw)
        cfg_flex.moe_token_dispatcher_type = "flex"
        cfg_flex.moe_flex_dispatcher_backend = "deepep"
        with tm.megatron_on_cpu():
            theirs = tm.step(mtd.MoEAlltoAllTokenDispatcher(El, local, cfg_a2a, pgs), *data)
            before = deep_ep.stats()
            ours = tm.step(mtd.MoEFlexTokenDispatcher(El, local, cfg_flex, pgs), *data)
            after = deep_ep.stats()
        tm.compare(ours, theirs, "rank %d T %d %s" % (rank, T, dtype))
        assert after["layouts"] - before["layouts"] == 1
        assert after["cached_dispatches"] - before["cached_dispatches"] == 1   # combine's backward
        rows.append("megatron flex/deepep vs alltoall T=%d drop=%.2f %s: tokens, counts, probs "
                    "equal; out, grads within %s" % (T, drop, str(dtype)[6:],
                                                      "1e-6" if dtype == torch.float32 else "1e-2"))
    if rank == 0:
        print("\n".join(rows))
    parallel_state.destroy_model_parallel()
    _close(rank)


@pytest.mark.skipif(not _have("megatron.core"), reason="megatron-core does not import")
def test_megatron_flex_dispatcher_deepep_backend_matches_alltoall():
    torchrun(2, __file__, "megatron")


# ---------------------------------------------------------------------------
# DeepSpeed AutoEP: comm_backend="deepep"
# ---------------------------------------------------------------------------


class _MixtralBlock(torch.nn.Module):
    """A Hugging Face Mixtral MoE block as AutoEP finds it: a `gate` Linear
    and `experts` with fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (the "fused_3d" storage), which AutoEPMoELayer's constructor repacks."""

    def __init__(self, E, H, I, seed):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.gate = torch.nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g))
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
        self.experts.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g) / I ** 0.5)


def _autoep_layers(W, rank, E, K, H, I, score_apply, max_tokens):
    """DeepSpeed's own AutoEPMoELayer, built from one source block for each
    comm_backend ("comm", "deepep") as AutoEP's module replacement builds it
    (the Mixtral preset's spec; the sequential expert loop, as torch's
    grouped GEMM is CUDA-only), its EP group from set_deepspeed_parallelism."""
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig, MoELayerSpec
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    spec = MoELayerSpec(
        moe_module_name="model.layers.0.mlp", model_family="mixtral", router_name="gate",
        experts_name="experts", expert_storage="fused_3d", expert_w1_name="gate_up_proj",
        expert_w2_name="down_proj", expert_w3_name=None, num_experts=E, top_k=K, hidden_size=H,
        ffn_hidden_size=I, score_func="softmax", score_apply="post", route_norm=True,
        gate_bias=False, return_router_logits=False, router_logits_capture_target="none",
        router_logits_capture_index=None, router_logits_capture_layer_name=None,
        has_shared_experts=False, shared_experts_name="")
    source = _MixtralBlock(E, H, I, seed=77).bfloat16().to(DEV)
    layers = {}
    for backend in ("comm", "deepep"):
        config = AutoEPConfig(enabled=True, autoep_size=W, use_grouped_mm=False,
                              score_apply=score_apply, comm_backend=backend,
                              comm_max_tokens_per_rank=max_tokens)
        layer = AutoEPMoELayer(spec, source, ep_size=W, ep_rank=rank, config=config)
        layer.set_deepspeed_parallelism()
        layers[backend] = layer
    return layers


def _cpu_barrier_without_device_ids(gloo=False):
    """The one CUDA-only call on AutoEP's deepep path: _deepep_route's first
    call runs dist.barrier(group, device_ids=[tokens.device.index]), and a
    CPU tensor's index is None, which torch refuses. Patched here, and only
    for that argument: deepspeed.comm.barrier drops device_ids=[None] (and,
    on a gloo group of processes sharing a GPU, any device_ids: only NCCL
    takes them) and is otherwise DeepSpeed's. Everything else runs as
    released."""
    import deepspeed.comm as ds_dist
    released = ds_dist.barrier

    def barrier(*args, device_ids=None, **kwargs):
        drop = gloo or device_ids == [None]
        return released(*args, device_ids=None if drop else device_ids, **kwargs)
    ds_dist.barrier = barrier


def _max_diff(a, b):
    return float((a.float() - b.float()).abs().max())


def _training_step(module, forward, x0, gy):
    """forward(x) on a fresh leaf copy x of x0, then the backward of
    sum(y * gy): (y detached, x's gradient, module's parameters, the
    epx.deep_ep stats after the forward and after the backward). No live
    forward graph stays behind: it would be a second one for the next
    checkpointed forward's replay to choose from."""
    import epx.deep_ep as deep_ep
    x = x0.clone().requires_grad_(True)
    deep_ep.stats(reset=True)
    y = forward(x)
    fwd = deep_ep.stats()
    (y.float() * gy.float()).sum().backward()
    return y.detach(), x.grad, dict(module.named_parameters()), fwd, deep_ep.stats()


def deepspeed_worker():
    rank, W = _start()
    from torch.utils.checkpoint import checkpoint
    import deepspeed
    deepspeed.init_distributed(dist_backend=_backend())
    from deepspeed.module_inject import auto_ep_comm as aec
    if DEV == "cpu" or _shared_gpu():
        _cpu_barrier_without_device_ids(gloo=_shared_gpu())
    E, K, H, I = 8, 2, 16, 24
    rows = []
    for score_apply in ("post", "pre"):
        layers = _autoep_layers(W, rank, E, K, H, I, score_apply, max_tokens=64)
        gr = torch.Generator(device="cpu").manual_seed(500 + rank)
        x0 = torch.randn(2, 6 + rank, H, generator=gr).bfloat16().to(DEV)   # [B, S, H]
        gy = torch.randn(2, 6 + rank, H, generator=gr).bfloat16().to(DEV)
        for mode in ("plain", "checkpoint"):
            res = {}
            for backend, layer in layers.items():
                layer.zero_grad(set_to_none=True)
                forward = layer
                if mode == "checkpoint":
                    def forward(x, layer=layer):
                        return checkpoint(layer, x, use_reentrant=False)
                res[backend] = _training_step(layer, forward, x0, gy)
            y_c, xg_c, p_c, _, st_c = res["comm"]
            y_d, xg_d, p_d, fwd, st = res["deepep"]
            assert st_c == {"layouts": 0, "cached_dispatches": 0, "combines": 0}, st_c
            # bf16 rows summed in another order: within a bf16 ulp of the output
            torch.testing.assert_close(y_d, y_c, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(xg_d, xg_c, atol=1e-2, rtol=1e-2)
            for name in p_c:
                assert p_c[name].grad is not None and float(p_c[name].grad.abs().sum()) > 0, name
                torch.testing.assert_close(p_d[name].grad, p_c[name].grad, atol=1e-2, rtol=1e-2)
            # forward: one layout; the backward's combine-backward is a cached
            # dispatch, and the recompute repeats the forward's dispatch on
            # its handle (DeepEPCheckpointReplay): no second layout
            assert fwd["layouts"] == 1 and st["layouts"] == 1, st
            assert st["cached_dispatches"] == (2 if mode == "checkpoint" else 1), st
            grad_diff = max(_max_diff(p_d[n].grad, p_c[n].grad) for n in p_c)
            rows.append("deepspeed AutoEPMoELayer deepep vs comm (%s, %s): out %.2g, x.grad %.2g, "
                        "param grads %.2g max abs diff; layouts %d, cached dispatches %d" % (
                            score_apply, mode, _max_diff(y_d, y_c), _max_diff(xg_d, xg_c),
                            grad_diff, st["layouts"], st["cached_dispatches"]))
        aec.destroy_exchanges(layers["deepep"])
    if rank == 0:
        print("\n".join(rows))
    _close(rank)


@pytest.mark.skipif(not _have("deepspeed"), reason="deepspeed does not import")
def test_deepspeed_autoep_deepep_backend_matches_comm():
    torchrun(2, __file__, "deepspeed")


# ---------------------------------------------------------------------------
# NeMo Automodel: fused_a2a (deep_ep.Buffer) with its recompute replay
# ---------------------------------------------------------------------------


def nemo_worker():
    rank, W = _start()
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    from nemo_automodel.components.moe.megatron import fused_a2a as fa
    import epx.deep_ep as deep_ep
    assert fa.Buffer is deep_ep.Buffer
    E, K, H, T = 8, 2, 16, 12
    El = E // W
    g = torch.Generator(device="cpu").manual_seed(91)
    weights = (torch.randn(E, H, H, generator=g) / H ** 0.5).to(DEV)
    gr = torch.Generator(device="cpu").manual_seed(700 + rank)
    x0 = torch.randn(T + rank, H, generator=gr).to(DEV)
    logits0 = torch.randn(T + rank, E, generator=gr).to(DEV)
    grad = torch.randn(T + rank, H, generator=gr).to(DEV)
    group = dist.group.WORLD

    def layer(x, logits):
        """NeMo's DeepEP path: fused_dispatch, experts on local ids weighted by
        the received probs, fused_combine."""
        probs, idx = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        rx, ridx, rprobs, tokens_per_expert, handle = fa.fused_dispatch(
            x, idx, probs.float(), E, group)
        out = torch.zeros_like(rx)
        for e in range(El):
            hit = (ridx == e)
            p = (rprobs * hit).sum(dim=1, keepdim=True)
            out = out + torch.tanh(rx @ weights[rank * El + e]) * p
        assert int(tokens_per_expert.sum()) == int((ridx >= 0).sum())
        y, _ = fa.fused_combine(out, group, handle)
        return y

    def reference(x, logits):
        probs, idx = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        y = torch.zeros_like(x)
        for k in range(K):
            y = y + torch.tanh(torch.einsum("th,thg->tg", x, weights[idx[:, k]])) * probs[:, k:k + 1]
        return y

    rows = []
    for mode in ("plain", "checkpoint", "checkpoint+replay"):
        x = x0.clone().requires_grad_(True)
        logits = logits0.clone().requires_grad_(True)
        deep_ep.stats(reset=True)
        if mode == "plain":
            y = layer(x, logits)
        elif mode == "checkpoint":
            y = checkpoint(layer, x, logits, use_reentrant=False)
        else:
            y = checkpoint(layer, x, logits, use_reentrant=False,
                           context_fn=_nemo_replay_context(fa))
        fwd = deep_ep.stats()
        (y * grad).sum().backward()
        st = deep_ep.stats()
        xr = x0.clone().requires_grad_(True)
        lr = logits0.clone().requires_grad_(True)
        ref = reference(xr, lr)
        (ref * grad).sum().backward()
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits.grad, lr.grad, atol=1e-5, rtol=1e-5)
        recompute_layouts = st["layouts"] - fwd["layouts"]
        if mode == "checkpoint+replay":
            assert recompute_layouts == 0, st
        elif mode == "checkpoint":
            assert recompute_layouts == 1, st
        rows.append("nemo fused_a2a %s: out and grads within 1e-5 of no-DeepEP; layouts fwd %d, "
                    "recompute %d" % (mode, fwd["layouts"], recompute_layouts))
    if rank == 0:
        print("\n".join(rows))
    _close(rank)


def _nemo_replay_context(fa):
    """NeMo's checkpoint context (parallelizer._replay_deepep_dispatch_on_recompute,
    whose module needs transformers): a DispatchReplayRecorder per
    checkpointed call, recording in the forward, rewound and replayed in the
    recompute, through fused_a2a's own dispatch_replay_scope."""
    from contextlib import contextmanager

    def context_fn():
        recorder = fa.DispatchReplayRecorder()

        @contextmanager
        def scoped(mode):
            if mode == "replay":
                recorder.rewind()
            with fa.dispatch_replay_scope(recorder, mode):
                yield
        return scoped("record"), scoped("replay")
    return context_fn


@pytest.mark.skipif(not _have("nemo_automodel"), reason="nemo_automodel does not import")
@pytest.mark.parametrize("W", [1, 2])
def test_nemo_automodel_fused_a2a_with_recompute_replay(W):
    torchrun(W, __file__, "nemo")


# ---------------------------------------------------------------------------
# NeMo Automodel: its own MoE layer (Gate, GroupedExpertsDeepEP, the flex
# token dispatcher) against the same layer on its non-DeepEP path
# ---------------------------------------------------------------------------


def _nemo_model(E, K, H, I, L, dispatcher, dtype):
    """L decoder blocks, each NeMo's MoE (its Gate, routed experts on
    torch._grouped_mm, one shared expert) under `mlp`, as NeMo's models nest
    it: model.layers.<i>.mlp. dispatcher "deepep" builds GroupedExpertsDeepEP,
    "torch" GroupedExperts (all-gather, all-reduce)."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import MoE
    config = MoEConfig(n_routed_experts=E, n_shared_experts=1, n_activated_experts=K,
                       n_expert_groups=1, n_limited_groups=1, train_gate=True,
                       gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax",
                       route_scale=1.0, dim=H, inter_dim=I, moe_inter_dim=I,
                       norm_topk_prob=True, dtype=dtype)
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False,
                            experts="torch_mm", dispatcher=dispatcher)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MoE(config, backend)

        def forward(self, x):
            return x + self.mlp(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(L))

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x

    return Model().to(DEV)


def _nemo_weights(model, seed):
    """Every parameter from one seeded generator, the same on every rank
    (ExpertParallel then keeps each rank's experts)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            fan_in = p.shape[-2] if name.endswith("projs") else p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def _nemo_unfused_permute(model):
    """The one CUDA-only call on NeMo's DeepEP path: init_token_dispatcher
    sets moe_permute_fusion=True, whose permute is Transformer Engine's
    moe_permute_with_probs and whose index conversion a Triton kernel
    (fused_indices_to_multihot). Patched, on CPU or where Transformer Engine
    is not installed, to NeMo's own unfused path
    (_DeepepManager._indices_to_multihot, moe_utils.permute / unpermute with
    fused=False): the same permutation in torch ops. Everything else runs as
    released."""
    for block in model.layers:
        block.mlp.experts.token_dispatcher._comm_manager.permute_fusion = False


def _grad(p):
    return (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float()


def nemo_layer_worker():
    rank, W = _start()
    from torch.distributed.device_mesh import init_device_mesh
    from nemo_automodel.components.moe import parallelizer
    from nemo_automodel.components.moe.experts import GroupedExperts, GroupedExpertsDeepEP
    from nemo_automodel.components.moe.megatron import fused_a2a as fa, moe_utils
    import epx.deep_ep as deep_ep
    assert fa.Buffer is deep_ep.Buffer
    mesh = init_device_mesh(DEV, (W,), mesh_dim_names=("ep",))
    E, K, H, I, L = 8, 2, 32, 24, 2
    rows = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        gr = torch.Generator(device="cpu").manual_seed(600 + rank)
        x0 = torch.randn(2, 5 + 2 * rank, H, generator=gr).to(DEV, dtype)   # [B, S, H]
        gy = torch.randn(2, 5 + 2 * rank, H, generator=gr).to(DEV, dtype)
        for mode in ("plain", "ac", "ac-no-replay"):
            res = {}
            for dispatcher in ("torch", "deepep"):
                model = _nemo_model(E, K, H, I, L, dispatcher, dtype)
                _nemo_weights(model, seed=31)
                parallelizer.apply_ep(model, mesh)
                kind = GroupedExpertsDeepEP if dispatcher == "deepep" else GroupedExperts
                assert all(type(b.mlp.experts) is kind for b in model.layers)
                if dispatcher == "deepep" and (DEV == "cpu" or not moe_utils.HAS_TE):
                    _nemo_unfused_permute(model)
                if mode != "plain":
                    # NeMo's own activation checkpointing: ignore_router=True
                    # saves the router's projection and top-k and replays the
                    # forward's dispatch layouts in the recompute
                    # (_replay_deepep_dispatch_on_recompute); ignore_router=False
                    # recomputes them
                    parallelizer.apply_ac(model, ignore_router=(mode == "ac"),
                                          hidden_size=H, num_experts=E)
                res[dispatcher] = _training_step(model, model, x0, gy)
            y_t, xg_t, p_t, _, st_t = res["torch"]
            y_d, xg_d, p_d, fwd, st = res["deepep"]
            assert st_t == {"layouts": 0, "cached_dispatches": 0, "combines": 0}, st_t
            torch.testing.assert_close(y_d, y_t, atol=tol, rtol=tol)
            torch.testing.assert_close(xg_d, xg_t, atol=tol, rtol=tol)
            assert sorted(p_d) == sorted(p_t)
            for name in p_t:
                assert float(_grad(p_t[name]).abs().sum()) > 0, name
                torch.testing.assert_close(_grad(p_d[name]), _grad(p_t[name]), atol=tol, rtol=tol)
            # per block: one layout in the forward; the backward's combine
            # backward is a cached dispatch; NeMo's recompute replays the
            # forward's layout on its handle (a cached dispatch, no layout)
            # unless ignore_router=False, where it computes it again
            recompute_layouts = st["layouts"] - fwd["layouts"]
            assert fwd["layouts"] == L, fwd
            assert recompute_layouts == (L if mode == "ac-no-replay" else 0), st
            assert st["cached_dispatches"] == (2 * L if mode == "ac" else L), st
            grad_diff = max(_max_diff(_grad(p_d[n]), _grad(p_t[n])) for n in p_t)
            rows.append("nemo MoE deepep vs torch (%s, %s, %d blocks): out %.2g, x.grad %.2g, "
                        "param grads %.2g max abs diff; layouts fwd %d, recompute %d; cached "
                        "dispatches %d" % (str(dtype)[6:], mode, L, _max_diff(y_d, y_t),
                                           _max_diff(xg_d, xg_t), grad_diff, fwd["layouts"],
                                           recompute_layouts, st["cached_dispatches"]))
    if rank == 0:
        print("\n".join(rows))
    _close(rank)


@pytest.mark.skipif(not (_have("nemo_automodel") and _have("transformers")),
                    reason="nemo_automodel's MoE layer needs transformers (its model utilities)")
def test_nemo_automodel_moe_layer_deepep_matches_torch_dispatcher():
    torchrun(2, __file__, "nemo_layer")


if __name__ == "__main__":
    {"megatron": megatron_worker, "deepspeed": deepspeed_worker,
     "nemo": nemo_worker, "nemo_layer": nemo_layer_worker}[sys.argv[1]]()
