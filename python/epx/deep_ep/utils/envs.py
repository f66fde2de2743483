"""The process-group helpers DeepEP's tests import from ``deep_ep.utils.envs``."""
import os
import random
from typing import Tuple

import torch
import torch.distributed as dist

_SEED = {"global": 0}


def init_seed(global_seed: int) -> None:
    """Seeds Python, torch (and CUDA) with global_seed + rank."""
    _SEED["global"] = global_seed
    seed = get_local_seed()
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_global_seed() -> int:
    return _SEED["global"]


def get_local_seed() -> int:
    return _SEED["global"] + (dist.get_rank() if dist.is_initialized() else 0)


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Prints on rank 0 (once_in_node: on each node's local rank 0), flushed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = int(os.environ.get("LOCAL_RANK", rank))
    if (local if once_in_node else rank) == 0:
        print(s, flush=True)


def init_dist(local_rank: int, num_local_ranks: int,
              seed: int = 0) -> Tuple[int, int, dist.ProcessGroup]:
    """DeepEP's test launcher: MASTER_ADDR / MASTER_PORT, WORLD_SIZE nodes of
    num_local_ranks processes, this node RANK; NCCL on GPUs (bfloat16 on the
    current CUDA device by default), gloo on CPUs. -> (rank, world size,
    the group of all ranks)."""
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo",
                            init_method="tcp://%s:%d" % (ip, port),
                            world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    if cuda:
        torch.set_default_device("cuda")
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(
        list(range(num_local_ranks * num_nodes)))


def check_torch_deterministic() -> None:
    """Nothing to check: epx's results do not depend on arrival order."""


def check_nvlink_connections(group) -> None:
    """Nothing to check: epx takes NVLink where peers have it and NCCL's host
    API elsewhere (PCIe included)."""


def get_physical_domain_size(group=None) -> Tuple[int, int]:
    size = (group.size() if group is not None
            else dist.get_world_size() if dist.is_initialized() else 1)
    return 1, size


def get_logical_domain_size(group=None, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    return get_physical_domain_size(group)
