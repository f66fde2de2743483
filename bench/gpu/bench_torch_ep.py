#!/usr/bin/env python3
"""PyTorch's all_to_all_single beside bench_ep, on the same GPUs and the same
row counts (run under mpirun right after bench_ep, one process per GPU).

For each line of <workdir>/ep_counts.txt (a bench_ep configuration and rank
0's rows to each rank, its own included) every rank sends that many bf16
rows of H = 7168 to each peer (the counts mirrored: a rank's own count to
itself, rank 0's count to a peer to each peer) with
torch.distributed.all_to_all_single, timed with CUDA events (median of 20
after 3 warm-ups). Prints TORCH lines.

For each line of <workdir>/ep_permute.txt (bench_ep's expert-major dedup
dispatches: the unique rows a rank received, the expert-major rows they
expand to, epx's dispatch time) it times the PyTorch permute a DeepEP user
runs after DeepEP's dispatch to get the same expert-major rows (an
index_select of the received rows, ascending sources inside each local
expert's group, as Megatron's permute orders them), and prints a TARGET
line: epx's expert-major dispatch against DeepEP's dispatch (its published
figure on these GPUs, shared/PERFORMANCE.md: 0.658 ms at 8192 tokens, 0.344
at 4096; not measured here) plus that permute.

Usage: mpirun -np 2 python3 bench_torch_ep.py <workdir>
"""
import os
import sys

import torch
import torch.distributed as dist

from bench_timing import median_ms

H = 7168
LOCAL_EXPERTS = 128  # 256 experts on 2 ranks
DEEPEP_DISPATCH_MS = {8192: 0.658, 4096: 0.344}


def permute_lines(workdir, rank):
    """The expert-major permute after a rank-major exchange (rank 0 prints)."""
    path = os.path.join(workdir, "ep_permute.txt")
    if not os.path.exists(path):
        return
    gen = torch.Generator(device="cuda").manual_seed(7)
    for line in open(path).read().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        rows_in, expanded = int(fields["rows_in"]), int(fields["expanded_rows"])
        epx_ms, tokens = float(fields["dispatch_ms"]), int(fields["T"])
        recv = torch.randn(rows_in, H, device="cuda", dtype=torch.bfloat16)
        per = -(-expanded // LOCAL_EXPERTS)
        src = torch.randint(0, rows_in, (LOCAL_EXPERTS, per), device="cuda", generator=gen)
        index = torch.sort(src, dim=1).values.flatten()[:expanded].contiguous()
        out = torch.empty(expanded, H, device="cuda", dtype=torch.bfloat16)
        t = median_ms(lambda: torch.index_select(recv, 0, index, out=out))
        if rank == 0:
            name = line.split(" rows_in=")[0]
            deepep = DEEPEP_DISPATCH_MS.get(tokens)
            print(f"TORCH permute rows_in={rows_in} expanded_rows={expanded} ms={t:.4f} "
                  f"GBps={(rows_in + expanded) * H * 2 / t / 1e6:.0f} (as in: {name})", flush=True)
            if deepep is not None:
                print(f"TARGET expert-major dispatch ({name.split(' layout=')[0]}, "
                      f"{'fused' if 'path=fused' in name else 'host'} path) vs DeepEP {deepep} + torch permute "
                      f"{t:.3f} ms   {epx_ms:.4f} ms <= {deepep + t:.3f}", flush=True)


def main():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=size)
    lines = open(os.path.join(sys.argv[1], "ep_counts.txt")).read().splitlines()
    seen = set()
    for line in lines:
        parts = line.split()
        counts = [int(v) for v in parts[-size:]]
        name = " ".join(parts[:-size])
        own, other = counts[0], counts[1] if size > 1 else 0
        splits = [own if q == rank else other for q in range(size)]
        key = tuple(splits)
        if key in seen:
            continue
        seen.add(key)
        send = torch.randn(sum(splits), H, device="cuda", dtype=torch.bfloat16)
        recv = torch.empty(sum(splits), H, device="cuda", dtype=torch.bfloat16)
        t = median_ms(lambda: dist.all_to_all_single(recv, send, splits, splits), barrier=dist.barrier)
        if rank == 0:
            gbps = sum(splits) * H * 2 / t / 1e6
            print(f"TORCH all_to_all_single rows_per_peer={splits} ms={t:.4f} GBps={gbps:.0f} (as in: {name})",
                  flush=True)
    permute_lines(sys.argv[1], rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
