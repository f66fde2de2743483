"""EP on one GPU from torchrun: processes of one host sharing a GPU through
CUDA IPC (the ipc transport beneath an shm comm, src/cuda/xport/ipc.c).

- CPU (CI): epx.torch.comm_from_process_group's choice on an NCCL group,
  with torch's device queries and the store gather replaced: ranks on one
  GPU of one host get the shm comm (transport "ipc"), ranks on distinct
  GPUs NCCL's; transport="ipc" explicit takes it without gathering; a bad
  transport name is a ValueError naming it; the device key is the UUID
  (else the PCI address).
- GPU (skipped without CUDA): ``torchrun --nproc_per_node 2`` on one GPU
  (every process on device 0) with an NCCL process group, which NCCL
  itself cannot serve there: epx.deep_ep's dispatch/combine (DeepEP's V1
  and V2 calls, their gradients) against the plain PyTorch reference of
  tests/python/test_deep_ep.py, unchanged, through the comm that
  comm_from_process_group chose (checked to be the shm one, with its
  buffers on the host path where the fused one is refused, saying why).

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_ipc.py
"""
import os
import pathlib
import sys
import types

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from epx.torch import launch  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

HAS_GPU = torch.cuda.is_available() and epx.has_cuda()
FN = "epx.torch.comm_from_process_group"


# ---------------------------------------------------------------------------
# The choice of transport (CPU)
# ---------------------------------------------------------------------------


@pytest.fixture
def nccl_group(monkeypatch):
    """An NCCL group of 2 ranks as comm_from_process_group sees it, its store
    gather played by `gathered` (a list of every rank's device key)."""
    import torch.distributed as dist
    state = types.SimpleNamespace(gathered=None, gathers=0, shm=None)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")

    def gather(group, rank, size, mine, timeout_seconds, fn):
        state.gathers += 1
        assert timeout_seconds > 0 and fn == FN
        return state.gathered if state.gathered is not None else [mine] * size

    def shm(group, rank, size, config, transport="shm"):
        state.shm = transport
        return "shm comm"

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _props("GPU-aaaa"))
    monkeypatch.setattr(launch, "_gather_bounded", gather)
    monkeypatch.setattr(launch, "_shm_comm", shm)
    monkeypatch.setattr(launch, "_nccl_comm", lambda group, rank, size, config: "nccl comm")
    return state


def _props(uuid="GPU-0000", **pci):
    return types.SimpleNamespace(uuid=uuid, **pci)


def test_an_nccl_group_of_ranks_on_one_gpu_gets_the_shm_comm_with_ipc(nccl_group):
    assert et.comm_from_process_group(group="g") == "shm comm"
    assert nccl_group.shm == "ipc" and nccl_group.gathers == 1


def test_an_nccl_group_of_ranks_on_distinct_gpus_gets_nccl(nccl_group):
    nccl_group.gathered = [("host", "GPU-aaaa"), ("host", "GPU-bbbb")]
    assert et.comm_from_process_group(group="g") == "nccl comm"
    assert nccl_group.shm is None


def test_the_same_gpu_index_on_two_hosts_is_two_gpus(nccl_group):
    nccl_group.gathered = [("host-a", "GPU-aaaa"), ("host-b", "GPU-aaaa")]
    assert et.comm_from_process_group(group="g") == "nccl comm"


def test_two_of_four_ranks_on_one_gpu_is_enough(nccl_group):
    assert launch._shared_gpu(None, 0, 4, 5.0, FN) is not None   # every key the same
    nccl_group.gathered = [("h", "a"), ("h", "b"), ("h", "c"), ("h", "b")]
    assert launch._shared_gpu(None, 0, 4, 5.0, FN) == (1, 3)
    nccl_group.gathered = [("h", "a"), ("h", "b"), ("h", "c"), ("h", "d")]
    assert launch._shared_gpu(None, 0, 4, 5.0, FN) is None


def test_transport_ipc_explicit_takes_the_shm_comm_without_gathering(nccl_group):
    assert et.comm_from_process_group(group="g", transport="ipc") == "shm comm"
    assert nccl_group.shm == "ipc" and nccl_group.gathers == 0


def test_a_bad_transport_name_is_a_value_error_naming_it(nccl_group):
    with pytest.raises(ValueError) as e:
        et.comm_from_process_group(group="g", transport="cuda-ipc")
    assert "'cuda-ipc'" in str(e.value) and "'ipc'" in str(e.value)


def test_the_device_key_is_the_uuid_else_the_pci_address(monkeypatch):
    import socket
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: seen.append(d) or _props("GPU-1234"))
    assert launch._device_key() == (socket.gethostname(), "GPU-1234") and seen == [1]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=27,
                                                        pci_device_id=0))
    assert launch._device_key()[1] == "pci 0:27:0"


@pytest.mark.parametrize("gpus,local,backend", [(1, 2, "gloo"), (2, 2, "nccl"), (8, 4, "nccl"),
                                                (0, 1, "gloo")])
def test_init_process_group_takes_gloo_where_processes_share_a_gpu(monkeypatch, gpus, local,
                                                                   backend):
    import torch.distributed as dist
    got = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(launch, "launch_env", lambda: (0, local, 0, local))
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: got.append(b))
    et.init_process_group(init_method="file:///nonexistent")
    assert got == [backend]


# ---------------------------------------------------------------------------
# torchrun on one GPU (skipped without CUDA)
# ---------------------------------------------------------------------------


def worker():
    """One process of the torchrun job: every process on device 0, an NCCL
    group (on which no torch collective runs: NCCL refuses two ranks on one
    GPU), epx.deep_ep over the comm comm_from_process_group chose."""
    import torch.distributed as dist
    import test_deep_ep as td
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    torch.set_default_device("cuda")
    dist.init_process_group("nccl")
    import epx.deep_ep as deep_ep
    group = dist.group.WORLD
    W, r = dist.get_world_size(), dist.get_rank()
    # an NCCL group whose ranks share a GPU: the shm comm, its CUDA buffers
    # over the ipc transport (a rank-major buffer would take the fused path:
    # refused there, saying why)
    comm = et.comm_from_process_group(group)
    assert comm.transport == "ipc", comm.transport
    buf = epx.Buffer(comm, device=epx.Device.CUDA, dtype="bfloat16", hidden=64,
                     num_experts=4 * W, max_top_k=2, max_tokens_per_rank=16,
                     layout=epx.Layout.RANK_MAJOR)
    assert all(p == epx.ExchangePath.HOST for p in buf.peer_paths()), buf.peer_paths()
    assert "processes sharing one GPU (the ipc transport)" in buf.creation_note, buf.creation_note
    buf.close()
    comm.close()
    for dtype in (torch.float32, torch.bfloat16):
        td.check_v1(deep_ep, group, W, r, dtype)
        td.check_v2(deep_ep, group, W, r, dtype)
    td.check_gradients(deep_ep, group, W, r)
    print("rank %d OK" % r, flush=True)
    dist.destroy_process_group()


@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA torch and a libepx built with CUDA")
def test_torchrun_two_processes_on_one_gpu_run_deep_ep_through_ipc():
    torchrun(2, __file__, "worker", env={"EPX_DEEP_EP_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES":
                                         os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})


if __name__ == "__main__":
    worker()
