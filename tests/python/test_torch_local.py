"""Tests of epx.torch.run_local: W ranks as threads of one process, on the
CPU (epx.run_local) or all on one GPU. The CPU runs check the function, its
argument errors and its CUDA environment rules (with torch's CUDA state
stood in for); the GPU cases (pytest -k gpu, as bench/gpu-check.sh runs
them) run an MoE layer's forward and backward at W = 2, 4 and 8 on one GPU
against the same layer on W CPU thread ranks and the float64 reference,
each in a fresh process so that CUDA starts with the environment the fused
path needs. They skip without a GPU and a libepx built with EPX_BUILD_CUDA.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_torch_local.py
"""
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
import epx.torch.local as local  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402
from test_torch import (HAS_GPU, Problem, check_against_reference, close, layer_step,  # noqa: E402
                        reference)

W_ = epx.Weighting
HERE = pathlib.Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# On the CPU: epx.run_local, with the layer over it
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", [1, 2, 4])
def test_cpu_ranks_return_results_by_rank(W):
    def rank(comm, base, scale=1):
        assert threading_name_ok(comm)
        return (base + comm.rank * scale, comm.size)
    assert et.run_local(W, rank, 10, scale=3, timeout_seconds=TIMEOUT) == \
        [(10 + 3 * r, W) for r in range(W)]


def threading_name_ok(comm):
    import threading
    name = threading.current_thread().name
    return comm.size == 1 or name == "epx-rank-%d" % comm.rank


@pytest.mark.parametrize("W", [2, 4])
def test_cpu_ranks_run_the_moe_layer_forward_and_backward(W):
    """An MoE layer on W CPU thread ranks against the float64 reference
    (device="cpu" is epx.run_local)."""
    p = Problem(SEED, W, T=24, H=16, F=8, E=8, K=2)
    res = et.run_local(W, layer_step, p, W_.IN_COMBINE, "cpu", device="cpu",
                       timeout_seconds=TIMEOUT)
    check_against_reference(res, reference(p, W_.IN_COMBINE), p, (1e-5, 1e-4))


def test_cpu_ranks_run_the_token_dispatcher():
    """TokenDispatcher over a run_local comm: permute, the identity expert,
    unpermute gives back x (weights summing to 1)."""
    E, H, K, T = 8, 16, 2, 12

    def rank(comm):
        g = torch.Generator().manual_seed(SEED + comm.rank)
        x = torch.randn(T, H, generator=g)
        probs = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
        w, idx = probs.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        disp = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T)
        dense = torch.zeros(T, E).scatter(1, idx, w)
        hidden, _ = disp.token_permutation(x, dense, dense > 0)
        out, _ = disp.token_unpermutation(hidden)
        disp.buffer.close()
        return x, out
    for x, out in et.run_local(2, rank, timeout_seconds=TIMEOUT):
        close(out.double(), x.double(), (1e-5, 1e-5), "unpermute(permute(x))")


def test_a_rank_error_is_raised_with_its_rank():
    def rank(comm):
        if comm.rank == 1:
            raise KeyError("rank one failed")
        return comm.rank
    with pytest.raises(KeyError, match="rank one failed"):
        et.run_local(2, rank, timeout_seconds=2.0)


# ---------------------------------------------------------------------------
# Argument errors, each naming its argument
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw, name", [
    (dict(world_size=0), "world_size"), (dict(world_size=-2), "world_size"),
    (dict(world_size=True), "world_size"), (dict(world_size=2.0), "world_size"),
    (dict(world_size="2"), "world_size"), (dict(fn=None), "fn"), (dict(fn=3), "fn"),
    (dict(device="mps"), "device"), (dict(device="not a device"), "device"),
    (dict(device=3.5), "device"), (dict(timeout_seconds=0), "timeout_seconds"),
    (dict(timeout_seconds=-1.0), "timeout_seconds"),
    (dict(timeout_seconds="5"), "timeout_seconds"),
    (dict(timeout_seconds=True), "timeout_seconds")])
def test_argument_errors_name_the_argument(kw, name):
    args = dict(world_size=2, fn=lambda comm: comm.rank, device="cpu", timeout_seconds=TIMEOUT)
    args.update(kw)
    with pytest.raises(epx.EpxError, match=name) as e:
        et.run_local(args.pop("world_size"), args.pop("fn"), **args)
    assert e.value.status == epx.Status.ERROR_INVALID_ARGUMENT


@pytest.mark.skipif(HAS_GPU, reason="CUDA is here: the refusal is for machines without it")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(epx.EpxError, match="device") as e:
        et.run_local(2, lambda comm: 0, device="cuda", timeout_seconds=TIMEOUT)
    assert e.value.status == epx.Status.ERROR_UNSUPPORTED


# ---------------------------------------------------------------------------
# The CUDA environment rules, torch's CUDA state stood in for
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch and libepx report CUDA; `state["initialized"]` says whether
    CUDA has started; torch.cuda.init is counted, not run."""
    state = dict(initialized=False, inits=0)
    monkeypatch.setattr(local._epx, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "init", lambda: state.update(inits=state["inits"] + 1))
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    return state


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("W", [2, 8, 16])
def test_cuda_environment_is_set_before_cuda_starts(fake_cuda, W):
    local._cuda_environment(W, CUDA0)
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == (str(W) if W > 8 else None)
    assert fake_cuda["inits"] == 1


def test_cuda_environment_keeps_what_the_caller_set(fake_cuda, monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "12")
    local._cuda_environment(4, CUDA0)
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "12"


@pytest.mark.parametrize("initialized", [False, True])
def test_too_few_connections_name_the_variable(fake_cuda, monkeypatch, initialized):
    fake_cuda["initialized"] = initialized
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2")
    with pytest.raises(epx.EpxError, match="CUDA_DEVICE_MAX_CONNECTIONS.*at least 4|"
                       "CUDA_DEVICE_MAX_CONNECTIONS=4") as e:
        local._cuda_environment(4, CUDA0)
    assert e.value.status == epx.Status.ERROR_INVALID_ARGUMENT
    assert fake_cuda["inits"] == 0


def test_started_cuda_with_the_default_queues_refuses_more_than_eight(fake_cuda, monkeypatch):
    fake_cuda["initialized"] = True
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    local._cuda_environment(8, CUDA0)  # CUDA's default is 8 queues
    with pytest.raises(epx.EpxError, match="CUDA_DEVICE_MAX_CONNECTIONS=16"):
        local._cuda_environment(16, CUDA0)


def test_started_cuda_with_lazy_loading_warns_that_the_host_path_serves(fake_cuda, monkeypatch):
    fake_cuda["initialized"] = True
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # the host path needs no queues
    with pytest.warns(RuntimeWarning, match="CUDA_MODULE_LOADING=EAGER"):
        local._cuda_environment(8, CUDA0)
    assert fake_cuda["inits"] == 0


def test_a_device_torch_does_not_see_is_refused(fake_cuda):
    with pytest.raises(epx.EpxError, match="cuda:3"):
        local._cuda_environment(2, torch.device("cuda", 3))


# ---------------------------------------------------------------------------
# On one GPU: W ranks against W CPU thread ranks
# ---------------------------------------------------------------------------


def gpu_case(W):
    """The GPU case's body (run in a fresh process by the test below): an
    MoE layer's forward and backward on W ranks sharing one GPU, against
    the same layer on W CPU thread ranks and the float64 reference. Exits
    non-zero on a mismatch (the assertion's message says which tensor)."""
    p = Problem(SEED, W, T=32, H=32, F=16, E=16, K=2)
    kw = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    gpu = et.run_local(W, layer_step, p, W_.IN_COMBINE, "cuda", device="cuda",
                       timeout_seconds=TIMEOUT, **kw)
    cpu = et.run_local(W, layer_step, p, W_.IN_COMBINE, "cpu", device="cpu",
                       timeout_seconds=TIMEOUT, **kw)
    tol = (1e-4, 1e-3)
    for rank, (g, c) in enumerate(zip(gpu, cpu)):
        for k in ("out", "grad_x", "router", "w1", "w2", "aux"):
            close(g[k], c[k], tol, "%s rank %d, GPU vs CPU ranks (W=%d)" % (k, rank, W))
    check_against_reference(gpu, reference(p, W_.IN_COMBINE, aux_coeff=0.01, z_coeff=0.001),
                            p, tol)
    print("W=%d ranks on one GPU match %d CPU ranks: OK" % (W, W))


gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and a libepx built with EPX_BUILD_CUDA")


@gpu
@pytest.mark.parametrize("W", [2, 4, 8])
def test_gpu_moe_on_w_ranks_of_one_gpu_matches_w_cpu_ranks(W):
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER", CUDA_DEVICE_MAX_CONNECTIONS=str(W),
               EPX_TEST_SEED=str(SEED),
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "python"),
                                          os.environ.get("PYTHONPATH", "")]))
    if env.get("EPX_LIBRARY"):  # the child runs in tests/python
        env["EPX_LIBRARY"] = os.path.abspath(env["EPX_LIBRARY"])
    code = "import test_torch_local as t; t.gpu_case(%d)" % W
    r = subprocess.run([sys.executable, "-c", code], cwd=str(HERE), env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, "W=%d on one GPU (EPX_TEST_SEED=%d):\n%s\n%s" % (
        W, SEED, r.stdout[-4000:], r.stderr[-8000:])
