"""Per-call overhead of epx.deep_ep against the epx.torch calls it makes
(one rank over a group of one, small rows so the exchange itself is cheap):
the median and min of N timed calls of each, interleaved, after a warm-up.
DEVICE=cuda times them on the GPU (each call followed by a synchronize).

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python bench/deep_ep_overhead.py
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import epx
import epx.torch as et
import epx.deep_ep as deep_ep

T, H, E, K = int(os.environ.get("T", 128)), int(os.environ.get("H", 256)), 8, 2
N = int(os.environ.get("N", 2000))
DEV = os.environ.get("DEVICE", "cpu")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(ours, theirs):
    """(median, min) of each, the two calls interleaved (the machine's load
    falls on both alike)."""
    for _ in range(50):
        ours()
        theirs()
    a, b = [], []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        ours()
        _sync()
        t1 = time.perf_counter_ns()
        theirs()
        _sync()
        t2 = time.perf_counter_ns()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return [(statistics.median(v) / 1000.0, min(v) / 1000.0) for v in (a, b)]


def main():
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).bfloat16().to(DEV)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEV)
    w = torch.rand(T, K, generator=g).to(DEV)
    group = dist.group.WORLD

    b1 = deep_ep.Buffer(group)
    per_rank, _, per_expert, in_rank, _ = b1.get_dispatch_layout(idx, E)
    recv_x, ri, rw, counts, h1, _ = b1.dispatch(x, num_tokens_per_rank=per_rank,
                                                is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=idx,
                                                topk_weights=w)
    eb = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    ex, _, ew, h2, _ = eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True)

    # the same epx.torch calls on a buffer of the same config
    comm = epx.Comm.create_self()
    b = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                       dtype=torch.bfloat16, layout=epx.Layout.RANK_MAJOR, device=DEV,
                       exchange=epx.Exchange.DEDUP)
    idx32 = idx.to(torch.int32)
    d = et.dispatch(b, x, idx32, w, weighting=epx.Weighting.NONE, recorder=False,
                    exact_size=True)

    rows = []

    def row(name, ours, theirs):
        (a, a_min), (c, c_min) = timed(ours, theirs)
        rows.append((name, a, c, a - c, a_min - c_min))

    with torch.no_grad():
        row("V1 dispatch (layout)", lambda: b1.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
            lambda: et.dispatch(b, x, idx32, w, weighting=epx.Weighting.NONE, recorder=False,
                                exact_size=True))
        row("V1 dispatch (handle=)", lambda: b1.dispatch(x, handle=h1),
            lambda: et.dispatch(b, x, handle=d))
        row("V1 combine", lambda: b1.combine(recv_x, h1), lambda: et.combine(d, recv_x))
        row("V1 get_dispatch_layout", lambda: b1.get_dispatch_layout(idx, E), lambda: None)
        row("V2 dispatch (do_expand)", lambda: eb.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True),
            lambda: et.dispatch(b, x, idx32, w, weighting=epx.Weighting.NONE, recorder=False,
                                exact_size=True))
        row("V2 dispatch (handle=, expand)", lambda: eb.dispatch(x, handle=h2, do_expand=True),
            lambda: et.dispatch(b, x, handle=d))
        row("V2 combine (expand)", lambda: eb.combine(ex, h2), lambda: et.combine(d, recv_x))
    print("T=%d H=%d E=%d K=%d bf16, %s, 1 rank, %d calls (us)" % (T, H, E, K, DEV, N))
    print("| call | epx.deep_ep | epx.torch | overhead (median) | overhead (min) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, a, c, o, m in rows:
        print("| %s | %.1f | %.1f | %.1f | %.1f |" % (name, a, c, o, m))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
