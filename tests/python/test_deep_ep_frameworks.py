"""The frameworks' own released DeepEP paths, unchanged, with ``import
deep_ep`` resolved to epx.deep_ep (epx.deep_ep.install()), against each
framework's path without DeepEP, on CPU under torchrun (gloo):

- Megatron-core (0.16.1 here): MoEFlexTokenDispatcher with
  moe_flex_dispatcher_backend="deepep" against MoEAlltoAllTokenDispatcher:
  tokens, tokens_per_expert, permuted probs, output and gradients (hidden,
  router logits). The flex dispatcher needs TP x EP > 1: 2 processes.
- DeepSpeed 0.19.8 AutoEP: AutoEPMoELayer._deepep_route (comm_backend
  "deepep": DeepEPExchange on deep_ep.ElasticBuffer, deepep_dispatch /
  deepep_combine, its checkpoint replay) against the "comm" backend's
  semantics (each token's top-k experts' outputs weighted by the router's
  scores), outputs and gradients; under activation checkpointing its
  recompute replays the forward's handle (no second layout).
- NeMo Automodel 0.7.0: fused_a2a's fused_dispatch / fused_combine
  (deep_ep.Buffer), with its dispatch-replay recorder under activation
  checkpointing, against the same layer computed without DeepEP: the
  recompute's dispatches exchange no layout (counted).

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


def _start():
    import torch.distributed as dist
    torch.set_num_threads(1)
    import epx.deep_ep
    epx.deep_ep.install()           # before the frameworks import DeepEP
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
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
        cfg_a2a = tm.config(E, K, H, **kw)
        cfg_flex = tm.config(E, K, H, **kw)
        cfg_flex.moe_token_dispatcher_type = "flex"
        cfg_flex.moe_flex_dispatcher_backend = "deepep"
        if drop:
            # dropped routes (probs 0) become -1 only where the flex dispatcher
            # is told that capacity drops happen
            cfg_flex.moe_expert_capacity_factor = 1.0
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


class _Experts(torch.nn.Module):
    """Local experts as AutoEP calls them: experts(rows, counts [E_local])."""

    def __init__(self, weights):
        super().__init__()
        self.w = torch.nn.Parameter(weights.clone())

    def forward(self, rows, counts):
        outs = [torch.tanh(chunk.float() @ self.w[e]).to(rows.dtype) for e, chunk in
                enumerate(torch.split(rows, counts.tolist()))]
        return torch.cat(outs) if outs else rows[:0]


def _autoep_layer(group, E, K, H, W, rank, weights, max_tokens, score_apply):
    """An object with the attributes AutoEPMoELayer._deepep_route reads, so
    DeepSpeed's own method runs unchanged."""
    import types
    from deepspeed.module_inject import auto_ep_comm as aec
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    El = E // W
    layer = types.SimpleNamespace(
        ep_group=group, num_experts=E, top_k=K, hidden_size=H, num_local_experts=El,
        deepep_scope=aec.new_exchange_scope(), comm_max_tokens_per_rank=max_tokens,
        comm_num_sm=aec.DEFAULT_COMM_SMS, comm_qp_margin=4, _deepep_exchange=None,
        _deepep_replay=aec.DeepEPCheckpointReplay(), score_apply=score_apply,
        row_weighting_impl="eager",
        experts=_Experts(weights[rank * El:(rank + 1) * El]))
    layer.route = lambda x, ro: AutoEPMoELayer._deepep_route(layer, x, ro)
    if not torch.cuda.is_available():
        # _deepep_route's first call barriers with device_ids=[the CUDA index],
        # which a CPU tensor has not: the exchange is built here by DeepSpeed's
        # own shared_exchange, as that call would build it, skipping the barrier.
        layer._deepep_exchange = aec.shared_exchange(
            scope=layer.deepep_scope, ep_group=group, num_experts=E, top_k=K, hidden_size=H,
            num_max_tokens_per_rank=max_tokens, num_sms=layer.comm_num_sm,
            qp_margin=layer.comm_qp_margin)
    return layer


def _comm_reference(x, idx, scores, weights, score_apply):
    """The "comm" backend's result: sum_k score * expert(x) ("post"), or
    expert(score * x) ("pre")."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        w = weights[idx[:, k]]                                  # [T, H, H]
        s = scores[:, k:k + 1].float()
        if score_apply == "pre":
            xin = (x.float() * s).to(x.dtype).float()
            out = out + torch.tanh(torch.einsum("th,thg->tg", xin, w)).to(x.dtype).float()
        else:
            y = torch.tanh(torch.einsum("th,thg->tg", x.float(), w)).to(x.dtype)
            out = out + (y.float() * s).to(x.dtype).float()
    return out.to(x.dtype)


def deepspeed_worker():
    rank, W = _start()
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")   # deepspeed.comm over the same group
    from deepspeed.module_inject import auto_ep_comm as aec
    from deepspeed.module_inject.auto_ep_layer import RouterOutput
    import epx.deep_ep as deep_ep
    E, K, H, T = 8, 2, 16, 12
    g = torch.Generator(device="cpu").manual_seed(77)
    weights = (torch.randn(E, H, H, generator=g) / H ** 0.5).to(DEV)
    rows = []
    for score_apply in ("post", "pre"):
        gr = torch.Generator(device="cpu").manual_seed(500 + rank)
        x0 = torch.randn(T + rank, H, generator=gr).bfloat16().to(DEV)
        logits0 = torch.randn(T + rank, E, generator=gr).to(DEV)
        grad = torch.randn(T + rank, H, generator=gr).bfloat16().to(DEV)
        layer = _autoep_layer(dist.group.WORLD, E, K, H, W, rank, weights, 32, score_apply)

        def route(x, logits):
            probs = torch.softmax(logits, dim=-1)
            scores, idx = torch.topk(probs, K, dim=-1)
            counts = torch.bincount(idx.reshape(-1), minlength=E).float()
            return layer.route(x, RouterOutput(scores, idx, counts))

        for checkpointed in (False, True):
            x = x0.clone().requires_grad_(True)
            logits = logits0.clone().requires_grad_(True)
            deep_ep.stats(reset=True)
            out = (checkpoint(route, x, logits, use_reentrant=False) if checkpointed
                   else route(x, logits))
            (out.float() * grad.float()).sum().backward()
            st = deep_ep.stats()
            xr = x0.clone().requires_grad_(True)
            lr = logits0.clone().requires_grad_(True)
            scores_r, idx_r = torch.topk(torch.softmax(lr, dim=-1), K, dim=-1)
            ref = _comm_reference(xr, idx_r, scores_r, weights, score_apply)
            (ref.float() * grad.float()).sum().backward()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(x.grad, xr.grad, atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(logits.grad, lr.grad, atol=3e-2, rtol=3e-2)
            assert float(logits.grad.abs().sum()) > 0                 # the router learns
            # forward: one layout; backward: combine's backward is a cached
            # dispatch; the recompute replays the forward's handle
            assert st["layouts"] == 1, st
            assert st["cached_dispatches"] == (2 if checkpointed else 1), st
            rows.append("deepspeed autoep deepep (%s, %s): out, x.grad, logits.grad within "
                        "2e-2/3e-2 of comm; layouts %d, cached %d" % (
                            score_apply, "checkpointed" if checkpointed else "plain",
                            st["layouts"], st["cached_dispatches"]))
        aec.destroy_exchanges(torch.nn.Module())
        layer._deepep_exchange.destroy()
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


if __name__ == "__main__":
    {"megatron": megatron_worker, "deepspeed": deepspeed_worker,
     "nemo": nemo_worker}[sys.argv[1]]()
