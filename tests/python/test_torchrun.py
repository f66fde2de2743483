"""torchrun + gloo on CPU: `python -m torch.distributed.run --nproc_per_node W`
jobs get an epx comm in one call (epx.torch.comm_from_process_group, the shm
transport; no MPI, no rebuild), and the MoE layer's step over it is the same
bits as the single-process run of the same W ranks as threads (the local
transport), within float tolerance of the float64 PyTorch MoE; the same
worker under mpirun maps no variables. A rank that stops coming is a
TimeoutError naming it, within the comm's timeout.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_torchrun.py
"""
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402
from test_torch import Problem, check_against_reference, layer_step, reference, run_layer  # noqa: E402

W_ = epx.Weighting
SHAPE = dict(T=24, H=16, F=8, E=8, K=2)
JOB_SECONDS = 240  # the whole torchrun job, start-up included


def _torchrun(W, *args, extra_env=None):
    env = dict(os.environ, EPX_LIBRARY=epx.library_path, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(v, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(W), __file__] + [str(a) for a in args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_SECONDS)


def _shm_names():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("epx-")}
    except FileNotFoundError:
        return set()


def layer_worker(out_dir, seed, W):
    """One rank of test_layer_under_torchrun_matches_the_single_process_run."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    et.init_process_group("gloo")
    rank = dist.get_rank()
    comm = et.comm_from_process_group(timeout_seconds=TIMEOUT)
    assert (comm.rank, comm.size) == (rank, W)
    p = Problem(seed, W, **SHAPE)
    res = layer_step(comm, p, W_.NONE, aux_loss_coeff=0.01)
    torch.save({k: v for k, v in res.items() if k != "stats"},
               os.path.join(out_dir, "rank%d.pt" % rank))
    comm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("W", [2, 4])
def test_layer_under_torchrun_matches_the_single_process_run(tmp_path, W):
    before = _shm_names()
    run = _torchrun(W, "layer-worker", tmp_path, SEED, W)
    assert run.returncode == 0, "torchrun failed:\n%s\n%s" % (run.stdout, run.stderr[-4000:])
    p = Problem(SEED, W, **SHAPE)
    local = run_layer(W, p, W_.NONE, aux_loss_coeff=0.01)
    got = [torch.load(tmp_path / ("rank%d.pt" % rank)) for rank in range(W)]
    for rank in range(W):
        for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
            assert torch.equal(got[rank][k], local[rank][k]), \
                "rank %d: %s differs (torchrun shm vs local threads) [EPX_TEST_SEED=%d]" % (
                    rank, k, SEED)
    check_against_reference(got, reference(p, W_.NONE, aux_coeff=0.01), p, (1e-5, 1e-4))
    assert _shm_names() <= before, "names left in /dev/shm: %s" % (_shm_names() - before)


def test_mpirun_job_needs_no_variable_mapping(tmp_path):
    """The same worker under `mpirun -np 2` (no torch variables, no MASTER_*,
    no MPI in libepx needed): et.init_process_group reads mpirun's, and the
    comm is the shm transport's; the same bits as the threads."""
    import shutil
    mpiexec = shutil.which("mpiexec")
    if not mpiexec:
        pytest.skip("needs mpiexec")
    env = dict(os.environ, EPX_LIBRARY=epx.library_path, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(v, None)
    run = subprocess.run([mpiexec, "-n", "2", sys.executable, __file__, "layer-worker",
                          str(tmp_path), str(SEED), "2"], env=env, capture_output=True, text=True,
                         timeout=JOB_SECONDS)
    assert run.returncode == 0, "mpiexec failed:\n%s\n%s" % (run.stdout, run.stderr[-4000:])
    local = run_layer(2, Problem(SEED, 2, **SHAPE), W_.NONE, aux_loss_coeff=0.01)
    for rank in range(2):
        got = torch.load(tmp_path / ("rank%d.pt" % rank))
        for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
            assert torch.equal(got[k], local[rank][k]), "rank %d: %s differs" % (rank, k)


def timeout_worker(seconds):
    """Rank 1 makes the comm, then stops coming; rank 0's barrier must time
    out naming rank 1."""
    import torch.distributed as dist
    et.init_process_group("gloo")
    comm = et.comm_from_process_group(timeout_seconds=seconds)
    if comm.rank == 1:
        time.sleep(seconds + 3)
        return
    start = time.monotonic()
    try:
        comm.barrier()
    except epx.TimeoutError as e:
        took = time.monotonic() - start
        print("timeout rank-1-named=%s within=%s" % ("rank 1 " in str(e), took < seconds + 5),
              flush=True)
        with pytest.raises(epx.PeerFailedError):
            comm.barrier()
    del dist


def test_a_rank_that_stops_coming_is_a_timeout_naming_it():
    run = _torchrun(2, "timeout-worker", 3.0)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "timeout rank-1-named=True within=True" in run.stdout, run.stdout + run.stderr[-3000:]


def test_shm_comm_across_processes_without_torch_distributed(tmp_path):
    """epx.Comm.from_shm directly (any launcher): an allgather over 3 processes
    sees every rank's block; a wrong size is refused by name."""
    code = ("import sys, numpy as np, epx\n"
            "r = int(sys.argv[1])\n"
            "c = epx.Comm.from_shm(%r, r, 3, timeout_seconds=%r)\n"
            "g = c.allgather(np.array([r, 7 * r]))\n"
            "assert (g[:, 1] == 7 * np.arange(3)).all(), g\n"
            "c.barrier(); c.close(); print('ok', r)\n") % ("epx-test-%d" % os.getpid(), TIMEOUT)
    env = dict(os.environ, EPX_LIBRARY=epx.library_path,
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.split() == ["ok", str(r)], out + err
    with pytest.raises(epx.InvalidArgumentError, match="rank is 3"):
        epx.Comm.from_shm("epx-x", 3, 3)
    with pytest.raises(epx.InvalidArgumentError, match="name is not such a name"):
        epx.Comm.from_shm("a/b", 0, 1)
    with pytest.raises(epx.TimeoutError, match="rank 0 did not create"):
        epx.Comm.from_shm("epx-nobody-%d" % os.getpid(), 1, 2, timeout_seconds=0.2)
    one = epx.Comm.from_shm("epx-one-%d" % os.getpid(), 0, 1)
    assert (one.rank, one.size) == (0, 1)
    assert one.allgather(np.arange(4)).tolist() == [[0, 1, 2, 3]]
    one.close()


def test_launch_env_reads_mpirun_and_torchrun_variables(monkeypatch):
    for names in et._LAUNCHERS:
        for v in names:
            monkeypatch.delenv(v, raising=False)
    assert et.launch_env() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert et.launch_env() == (3, 4, 1, 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert et.launch_env() == (0, 1, 0, 1)  # torchrun's own variables win


if __name__ == "__main__" and sys.argv[1:2] == ["layer-worker"]:
    layer_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__" and sys.argv[1:2] == ["timeout-worker"]:
    timeout_worker(float(sys.argv[2]))
