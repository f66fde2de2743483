"""NeMo Automodel's recompute on epx.deep_ep with and without its layout
replay, on one GPU: fused_a2a's fused_dispatch / fused_combine around the
experts of one MoE layer under activation checkpointing (forward + backward),
T=4096, H=4096, 64 experts, top-6, bf16 (issue 35's shape). The replay's
recompute moves no layout: the table says how many layouts each step made
and the step's time.

Run (one GPU): EPX_LIBRARY=build/libepx.so PYTHONPATH=python torchrun --nproc-per-node 1 bench/gpu/bench_deep_ep.py
"""
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import epx.deep_ep as deep_ep

T, H, E, K = 4096, 4096, 64, 6
STEPS = int(os.environ.get("STEPS", 10))


def main():
    deep_ep.install(force=os.environ.get("EPX_DEEP_EP") == "force")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    from torch.utils.checkpoint import checkpoint
    from nemo_automodel.components.moe.megatron import fused_a2a as fa
    W, rank = dist.get_world_size(), dist.get_rank()
    El = E // W
    g = torch.Generator(device="cuda").manual_seed(rank)
    x0 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g)
    wexp = torch.randn(El, H, H, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5
    group = dist.group.WORLD

    def layer(x):
        probs, idx = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        rx, ridx, rprobs, counts, handle = fa.fused_dispatch(x, idx, probs.float(), E, group)
        out = torch.zeros_like(rx)
        for e in range(El):
            p = (rprobs * (ridx == e)).sum(1, keepdim=True).to(rx.dtype)
            out = out + (rx @ wexp[e]) * p
        return fa.fused_combine(out, group, handle)[0]

    def replay_context():
        recorder = fa.DispatchReplayRecorder()

        @contextmanager
        def scoped(mode):
            if mode == "replay":
                recorder.rewind()
            with fa.dispatch_replay_scope(recorder, mode):
                yield
        return scoped("record"), scoped("replay")

    rows = []
    for name, kw in (("recompute, full dispatch", {}),
                     ("recompute, layout replayed", {"context_fn": replay_context})):
        def step():
            x = x0.clone().requires_grad_(True)
            y = checkpoint(layer, x, use_reentrant=False, **kw)
            y.float().sum().backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        deep_ep.stats(reset=True)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / STEPS * 1e3
        st = deep_ep.stats()
        rows.append((name, ms, st["layouts"] / STEPS, st["cached_dispatches"] / STEPS))
    if rank == 0:
        print("NeMo fused_a2a layer, checkpointed, T=%d H=%d E=%d top-%d bf16, %d GPU(s)"
              % (T, H, E, K, W))
        print("| step | ms | layouts a step | cached dispatches a step |")
        print("| --- | ---: | ---: | ---: |")
        for name, ms, lay, cached in rows:
            print("| %s | %.2f | %.1f | %.1f |" % (name, ms, lay, cached))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
