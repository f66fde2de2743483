"""Per-call overhead of epx.deep_ep against the epx.torch calls it makes
(one rank over a group of one, small rows so the exchange itself is cheap):
the median and min of N timed calls of each, interleaved, after a warm-up.
DEVICE=cuda times them on the GPU (each call followed by a synchronize).
BEFORE=<a checkout's python/epx/deep_ep> also times that copy of the package
(loaded beside this one as deep_ep_before, on the same epx and epx.torch),
the three calls interleaved: before and after side by side in one run.

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


def timed(*calls):
    """(median, min) of each, the calls interleaved (the machine's load
    falls on them alike)."""
    for _ in range(50):
        for f in calls:
            f()
    times = [[] for _ in calls]
    for _ in range(N):
        for f, v in zip(calls, times):
            t0 = time.perf_counter_ns()
            f()
            _sync()
            v.append(time.perf_counter_ns() - t0)
    return [(statistics.median(v) / 1000.0, min(v) / 1000.0) for v in times]


def load_before(path):
    """The deep_ep package at path, imported as deep_ep_before."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "deep_ep_before", os.path.join(path, "__init__.py"),
        submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deep_ep_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def setup(deep_ep, group, x, idx, w):
    """The epx.deep_ep calls timed, on buffers of this package."""
    b1 = deep_ep.Buffer(group)
    per_rank, _, per_expert, in_rank, _ = b1.get_dispatch_layout(idx, E)
    recv_x, ri, rw, counts, h1, _ = b1.dispatch(x, num_tokens_per_rank=per_rank,
                                                is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=idx,
                                                topk_weights=w)
    eb = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    ex, _, ew, h2, _ = eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True)
    return [
        lambda: b1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
        lambda: b1.dispatch(x, handle=h1),
        lambda: b1.combine(recv_x, h1),
        lambda: b1.get_dispatch_layout(idx, E),
        lambda: eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True),
        lambda: eb.dispatch(x, handle=h2, do_expand=True),
        lambda: eb.combine(ex, h2),
    ]


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

    ours = setup(deep_ep, group, x, idx, w)
    before = setup(load_before(os.environ["BEFORE"]), group, x, idx, w) \
        if os.environ.get("BEFORE") else None
    recv_x = ours[1]()[0]

    # the same epx.torch calls on a buffer of the same config
    comm = epx.Comm.create_self()
    b = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                       dtype=torch.bfloat16, layout=epx.Layout.RANK_MAJOR, device=DEV,
                       exchange=epx.Exchange.DEDUP)
    idx32 = idx.to(torch.int32)
    d = et.dispatch(b, x, idx32, w, weighting=epx.Weighting.NONE, recorder=False,
                    exact_size=True)

    rows = []
    names = ["V1 dispatch (layout)", "V1 dispatch (handle=)", "V1 combine",
             "V1 get_dispatch_layout", "V2 dispatch (do_expand)", "V2 dispatch (handle=, expand)",
             "V2 combine (expand)"]
    fresh = lambda: et.dispatch(b, x, idx32, w, weighting=epx.Weighting.NONE, recorder=False,
                                exact_size=True)
    again = lambda: et.dispatch(b, x, handle=d)
    fold = lambda: et.combine(d, recv_x)
    theirs = [fresh, again, fold, lambda: None, fresh, again, fold]
    with torch.no_grad():
        for i, name in enumerate(names):
            calls = [ours[i], theirs[i]] + ([before[i]] if before else [])
            got = timed(*calls)
            (a, a_min), (c, c_min) = got[0], got[1]
            rows.append((name, a, c, a - c, a_min - c_min)
                        + ((got[2][0], got[2][0] - c) if before else ()))
    print("T=%d H=%d E=%d K=%d bf16, %s, 1 rank, %d calls (us)" % (T, H, E, K, DEV, N))
    if before:
        print("| call | epx.torch | before | after | overhead before (median) | "
              "overhead after (median) | overhead after (min) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, a, c, o, m, bt, bo in rows:
            print("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |" % (name, c, bt, a, bo, o, m))
    else:
        print("| call | epx.deep_ep | epx.torch | overhead (median) | overhead (min) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, a, c, o, m in rows:
            print("| %s | %.1f | %.1f | %.1f | %.1f |" % (name, a, c, o, m))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
