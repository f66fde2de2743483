#!/usr/bin/env python3
"""A step (forward + backward) of each framework drop-in beside the
framework's own path, one rank, on a GPU:

  - Megatron-core: the six dispatcher methods of MoEAlltoAllTokenDispatcher
    against epx.megatron.EpxTokenDispatcher on the same routing_map/probs;
  - DeepSpeed: deepspeed.moe.layer.MoE against epx.deepspeed.MoE (the same
    state dict; top-k gating, capacity factor 1);
  - NeMo Automodel: epx.nemo.fused_dispatch / fused_combine, and DeepEP's
    own Buffer.dispatch / combine beside it when deep_ep imports (forward
    only: DeepEP's Buffer has no autograd).

The experts are as cheap as possible (the probabilities applied, or an
identity expert for DeepSpeed), so the times are the exchange paths'. Shape
(the issue's): T=4096 tokens, H=4096, 64 experts, top-6, bf16. Times are
CUDA-event medians (bench_timing.median_ms) over --iters steps. Prints one
line per framework (ratio: the framework's time over epx's) and last OK when each pair's outputs agree (else FAILED,
exit 1).

Usage (from the repository root; libepx with CUDA; megatron-core, deepspeed
installed; EPX_LIBRARY=<build>/libepx.so PYTHONPATH=python):
    python3 bench/gpu/bench_dropins.py [--tokens 4096] [--hidden 4096]
        [--experts 64] [--topk 6] [--iters 20] [--only megatron,deepspeed,nemo]
--device cpu is a smoke run of the script at a small shape (Megatron's CUDA
streams stubbed as tests/python/test_megatron.py does).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from bench_timing import median_ms  # noqa: E402  (beside this script)


def timer(device, iters):
    """median_ms on CUDA; on the CPU a perf_counter median."""
    if device.type == "cuda":
        return lambda fn: median_ms(fn, reps=iters)

    def cpu(fn):
        fn()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[iters // 2]
    return cpu


def routing(a, device):
    """Random router logits -> (routing_map [T, E] bool, probs [T, E] float32)."""
    g = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(a.tokens, a.experts, device=device, generator=g)
    top = torch.topk(logits, a.topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return routing_map, torch.softmax(logits, dim=1) * routing_map


def megatron(a, device, dtype, time_ms):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    import epx.megatron as em
    parallel_state.initialize_model_parallel()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=8,
                            num_moe_experts=a.experts, moe_router_topk=a.topk,
                            moe_router_pre_softmax=True, moe_token_dispatcher_type="alltoall",
                            params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            use_cpu_initialization=device.type == "cpu")
    routing_map, probs = routing(a, device)
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype, requires_grad=True)
    local = list(range(a.experts))

    def step(disp):
        h, p = disp.dispatch_preprocess(x, routing_map, probs)
        h, p = disp.token_dispatch(h, p)
        tokens, _, permuted = disp.dispatch_postprocess(h, p)
        out = tokens * permuted[:, None].to(dtype)
        out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(out)))
        out.sum().backward()
        return out.detach()

    theirs = MoEAlltoAllTokenDispatcher(a.experts, local, cfg, pgs)
    ours = em.EpxTokenDispatcher(a.experts, local, cfg, pgs)
    agree = (step(ours) - step(theirs)).abs().max().item()
    times = time_ms(lambda: step(theirs)), time_ms(lambda: step(ours))
    ours.close()
    parallel_state.destroy_model_parallel()
    return times, agree


def deepspeed_(a, device, dtype, time_ms):
    import deepspeed.moe.layer as dsl
    import epx.deepspeed as eds
    args = dict(num_experts=a.experts, k=a.topk, capacity_factor=1.0, min_capacity=4,
                use_rts=False)
    theirs = dsl.MoE(a.hidden, torch.nn.Identity(), **args).to(device)
    ours = eds.MoE(a.hidden, torch.nn.Identity(), **args).to(device)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype, requires_grad=True)

    def step(layer):
        out, l_aux, _ = layer(x)
        (out.float().sum() + l_aux).backward()
        return out.detach().float()

    agree = (step(ours) - step(theirs)).abs().max().item()
    times = time_ms(lambda: step(theirs)), time_ms(lambda: step(ours))
    ours.close()
    return times, agree


def nemo(a, device, dtype, time_ms):
    import epx.nemo as en
    routing_map, probs = routing(a, device)
    w, idx = torch.topk(probs, a.topk, dim=1)
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype)
    group = dist.group.WORLD

    @torch.no_grad()
    def ours():
        recv_x, _, recv_w, _, handle = en.fused_dispatch(x, idx, w, a.experts, group)
        out, _ = en.fused_combine(recv_x * recv_w.sum(1, keepdim=True).to(dtype), group, handle)
        return out

    theirs, agree = None, 0.0
    try:
        from deep_ep import Buffer
    except ImportError:
        Buffer = None
    if Buffer is not None:
        buf = Buffer(group, int(2e9), 0)

        @torch.no_grad()
        def theirs():
            layout = buf.get_dispatch_layout(idx, a.experts)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=layout[0],
                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
            out, _, _ = buf.combine(recv_x * recv_w.sum(1, keepdim=True).to(dtype), handle)
            return out
        agree = (ours() - theirs()).abs().max().item()
    times = (time_ms(theirs) if theirs else float("nan")), time_ms(ours)
    en.close()
    return times, agree


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", default="megatron,deepspeed,nemo")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        a.tokens, a.hidden, a.iters = min(a.tokens, 256), min(a.hidden, 64), min(a.iters, 3)
    else:
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    import deepspeed
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    dtype = torch.bfloat16
    time_ms = timer(device, a.iters)
    runs = {"megatron": megatron, "deepspeed": deepspeed_, "nemo": nemo}
    print("T=%d H=%d E=%d top-%d bf16, one rank on %s; ms per step (forward + backward; "
          "nemo: forward)"
          % (a.tokens, a.hidden, a.experts, a.topk, device))
    print("%-10s %12s %10s %8s %12s" % ("drop-in", "framework", "epx", "ratio", "max |diff|"))
    ok = True
    for name in a.only.split(","):
        if device.type == "cpu" and name == "megatron":
            sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
            from test_megatron import megatron_on_cpu
            with megatron_on_cpu():
                (t_fw, t_epx), agree = runs[name](a, device, dtype, time_ms)
        else:
            (t_fw, t_epx), agree = runs[name](a, device, dtype, time_ms)
        ok &= agree <= 2e-2
        print("%-10s %12.3f %10.3f %8.2f %12.3g" % (name, t_fw, t_epx, t_fw / t_epx, agree),
              flush=True)
    dist.destroy_process_group()
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
