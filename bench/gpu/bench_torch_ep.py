#!/usr/bin/env python3
"""PyTorch's all_to_all_single beside bench_ep, on the same GPUs and the same
row counts (run under mpirun right after bench_ep, one process per GPU).

For each line of <workdir>/ep_counts.txt (a bench_ep configuration and rank
0's rows to each rank, its own included) every rank sends that many bf16
rows of H = 7168 to each peer (the counts mirrored: a rank's own count to
itself, rank 0's count to a peer to each peer) with
torch.distributed.all_to_all_single, timed with CUDA events (median of 20
after 3 warm-ups). Prints TORCH lines.

Usage: mpirun -np 2 python3 bench_torch_ep.py <workdir>
"""
import os
import sys

import torch
import torch.distributed as dist

H = 7168


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
        for _ in range(3):
            dist.all_to_all_single(recv, send, splits, splits)
        torch.cuda.synchronize()
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
        ev[0].record()
        for i in range(20):
            dist.all_to_all_single(recv, send, splits, splits)
            ev[i + 1].record()
        torch.cuda.synchronize()
        t = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(20))[10]
        if rank == 0:
            gbps = sum(splits) * H * 2 / t / 1e6
            print(f"TORCH all_to_all_single rows_per_peer={splits} ms={t:.4f} GBps={gbps:.0f} (as in: {name})",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
