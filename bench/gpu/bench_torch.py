#!/usr/bin/env python3
"""PyTorch baselines for bench_gpu, on the same GPU and the same routing.

For each routing_<shape>.bin that bench_gpu wrote into <workdir>:
  - dense one-hot einsum: dispatch `sec,sm->ecm`, combine `sec,ecm->sm`
    (mask [T, E, C] in bf16; the dropless shape uses its dense_C with
    locations in choice order, as PERFORMANCE.md's table does);
  - index ops: dispatch = index_select of the kept routes' tokens in expert
    order; combine = index_add_ in float32 of w * expert_out, cast to bf16.
A device-to-device copy is timed in the same run as the ceiling. Times are
CUDA-event medians over calls rotated across three input sets (each far larger
than the 60 MB L2). Prints TORCH lines and, when <workdir>/epx_results.txt
exists, the epx / PyTorch ratios.

Usage: python3 bench_torch.py <workdir>
"""
import os
import sys

import numpy as np
import torch


def median_ms(fn, warm=5, reps=40):
    for i in range(warm):
        fn(i)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        fn(i)
        ev[i + 1].record()
    torch.cuda.synchronize()
    t = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    return t[reps // 2]


def load_routing(path):
    head = np.fromfile(path, dtype=np.int64, count=7)
    T, H, E, K, C, dense_C, layout = (int(v) for v in head)
    n = T * K
    body = np.fromfile(path, dtype=np.int32, offset=56)
    idx = body[:n].reshape(T, K)
    w = body[n:2 * n].view(np.float32).reshape(T, K)
    loc = body[2 * n:3 * n].reshape(T, K)
    return T, H, E, K, C, dense_C, idx, w, loc


def choice_order_locations(idx, C):
    """Locations in choice order (all first choices first), -1 past C."""
    T, K = idx.shape
    ek = idx.T.reshape(-1)  # (k, t) order
    ids = np.nonzero(ek >= 0)[0]
    ev = ek[ids]
    order = np.argsort(ev, kind="stable")
    se = ev[order]
    starts = np.searchsorted(se, se, side="left")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - starts
    loc = np.full(T * K, -1, dtype=np.int64)
    keep = rank < C
    t = ids % T
    k = ids // T
    loc[t[keep] * K + k[keep]] = rank[keep]
    return loc.reshape(T, K)


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/epx-gpu"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("TORCH device", torch.cuda.get_device_name(0), "torch", torch.__version__)
    nbytes = 1 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    b = torch.empty_like(a)
    t_copy = median_ms(lambda i: (b if i % 2 else a).copy_(a if i % 2 else b), 3, 21)
    copy_gbps = 2 * nbytes / (t_copy * 1e-3) / 1e9
    print(f"TORCH shape=- op=d2d_copy ms={t_copy:.4f} GBps={copy_gbps:.0f}")
    del a, b

    epx = {}
    path = os.path.join(work, "epx_results.txt")
    if os.path.exists(path):
        for line in open(path):
            f = line.split()
            if len(f) >= 4 and f[0] == "epx":
                epx[(f[1], f[2])] = float(f[3])
    out = open(os.path.join(work, "torch_results.txt"), "w")
    rows = []
    for name in ("A", "B", "C"):
        p = os.path.join(work, f"routing_{name}.bin")
        if not os.path.exists(p):
            continue
        T, H, E, K, C, dense_C, idx, w, loc = load_routing(p)
        P = 3
        xs = [torch.rand(T, H, device=dev, dtype=torch.float32).mul_(2).sub_(1).to(torch.bfloat16) for _ in range(P)]

        # Index ops: the kept routes, grouped by expert in token order.
        flat_e = idx.reshape(-1)
        keep = flat_e >= 0
        tok = np.repeat(np.arange(T), K)[keep]
        ee = flat_e[keep]
        ww = w.reshape(-1)[keep]
        order = np.argsort(ee, kind="stable")
        src = torch.from_numpy(tok[order].astype(np.int64)).to(dev)
        wsort = torch.from_numpy(ww[order].astype(np.float32)).to(dev)
        R = src.numel()
        eos = [torch.rand(R, H, device=dev).mul_(2).sub_(1).to(torch.bfloat16) for _ in range(P)]
        t_gather = median_ms(lambda i: torch.index_select(xs[i % P], 0, src))

        def index_combine(i):
            acc = torch.zeros(T, H, device=dev, dtype=torch.float32)
            acc.index_add_(0, src, eos[i % P].float() * wsort[:, None])
            return acc.to(torch.bfloat16)

        t_index_add = median_ms(index_combine)
        del eos

        # Dense one-hot.
        Cd = C if C > 0 else dense_C
        dloc = loc if C > 0 else choice_order_locations(idx, Cd)
        tt, kk = np.nonzero(dloc >= 0)
        ti = torch.from_numpy(tt.astype(np.int64)).to(dev)
        ei = torch.from_numpy(idx[tt, kk].astype(np.int64)).to(dev)
        li = torch.from_numpy(dloc[tt, kk].astype(np.int64)).to(dev)
        wi = torch.from_numpy(w[tt, kk].astype(np.float32)).to(dev)
        mask = torch.zeros(T, E, Cd, device=dev, dtype=torch.bfloat16)
        mask[ti, ei, li] = 1
        mask_w = torch.zeros(T, E, Cd, device=dev, dtype=torch.bfloat16)
        mask_w[ti, ei, li] = wi.to(torch.bfloat16)
        t_dense_d = median_ms(lambda i: torch.einsum("sec,sm->ecm", mask, xs[i % P]))
        del xs
        eds = [torch.rand(E, Cd, H, device=dev).mul_(2).sub_(1).to(torch.bfloat16) for _ in range(P)]
        t_dense_c = median_ms(lambda i: torch.einsum("sec,ecm->sm", mask_w, eds[i % P]))
        del eds, mask, mask_w
        torch.cuda.empty_cache()

        for op, ms in (("dense_dispatch", t_dense_d), ("dense_combine", t_dense_c),
                       ("index_dispatch", t_gather), ("index_add_combine", t_index_add)):
            print(f"TORCH shape={name} op={op} ms={ms:.4f}")
            out.write(f"torch {name} {op} {ms:.6f}\n")
        ed, ec = epx.get((name, "dispatch")), epx.get((name, "combine"))
        rows.append((name, T, H, E, K, t_dense_d, t_dense_c, t_gather, t_index_add, ed, ec))
    out.write(f"torch - d2d_copy {t_copy:.6f}\n")
    out.close()

    print()
    print("| shape (T, H, E, K) | dense dispatch | dense combine | torch dispatch | torch combine "
          "| epx dispatch | epx combine | epx vs torch (d / c) | epx vs dense (d / c) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, T, H, E, K, dd, dc, g, ia, ed, ec in rows:
        def f(v):
            return f"{v:.3f} ms" if v is not None else "-"
        ratio_t = f"{g / ed:.1f}x / {ia / ec:.1f}x" if ed and ec else "-"
        ratio_d = f"{dd / ed:.1f}x / {dc / ec:.1f}x" if ed and ec else "-"
        print(f"| {name}: {T}, {H}, {E}, {K} | {f(dd)} | {f(dc)} | {f(g)} | {f(ia)} | {f(ed)} | {f(ec)} "
              f"| {ratio_t} | {ratio_d} |")
    print(f"TORCH copy ceiling {copy_gbps:.0f} GB/s")


if __name__ == "__main__":
    main()
