"""Tests of epx.torch: the MoE layer against a pure-PyTorch float64 MoE on
1, 2 and 4 ranks (threads of the local transport, and MPI processes under
mpirun through a gloo process group), every gradient including the router's
under every weighting, checkpoint replay, torch.compile without graph breaks,
errors as Python exceptions. GPU tests (1 and 2 GPUs, CUDA-graph
capture) run where torch sees a GPU and libepx has CUDA, and skip elsewhere.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python
(make test does, with the Python that has torch). EPX_TEST_SEED=<n> repeats
a run.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from test_epx import SEED, TIMEOUT, assert_close  # noqa: E402

W_ = epx.Weighting
REPO = pathlib.Path(__file__).resolve().parents[2]
HAS_GPU = torch.cuda.is_available() and epx.has_cuda()
torch.set_num_threads(1)  # ranks are threads already; the machine has few cores


# ---------------------------------------------------------------------------
# The problem: global weights and per-rank inputs, made from one seed
# ---------------------------------------------------------------------------


class Problem:
    """Router [E, H], all E experts' SwiGLU weights, and per-rank x and
    output gradients, in float64 (rounded through `dtype` where the layer
    holds them in it)."""

    def __init__(self, seed, W, T, H, F, E, K, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.W, self.T, self.H, self.F, self.E, self.K, self.dtype = W, T, H, F, E, K, dtype

        def rounded(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale
                    ).to(dtype).double()
        self.router = torch.randn(E, H, generator=g, dtype=torch.float64).float().double()
        self.w1 = rounded(E, H, 2 * F, scale=H ** -0.5)
        self.w2 = rounded(E, F, H, scale=F ** -0.5)
        self.x = [rounded(T, H) for _ in range(W)]
        self.g = [rounded(T, H) for _ in range(W)]


def swiglu(x, w1, w2):
    gate, up = (x @ w1).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2


def reference(p, weighting, renormalize=True, aux_coeff=0.0, z_coeff=0.0):
    """The same MoE in plain float64 PyTorch, all ranks' tokens at once:
    returns out per rank, the loss's gradients (x per rank, router, w1, w2)
    and the losses per rank. The loss is sum_r <out_r, g_r> + aux_r + z_r."""
    router = p.router.clone().requires_grad_(True)
    w1, w2 = p.w1.clone().requires_grad_(True), p.w2.clone().requires_grad_(True)
    xs = [x.clone().requires_grad_(True) for x in p.x]
    outs, losses, total = [], [], 0.0
    for x, g in zip(xs, p.g):
        logits = x @ router.t()
        prob = torch.softmax(logits, dim=1)
        idx = torch.topk(prob.detach(), p.K, dim=1).indices
        w = prob.gather(1, idx)
        if renormalize:
            w = w / w.sum(1, keepdim=True)
        out = torch.zeros_like(x)
        for k in range(p.K):
            for e in range(p.E):
                rows = idx[:, k] == e
                if not rows.any():
                    continue
                wk = w[rows, k:k + 1]
                if weighting == W_.IN_DISPATCH:
                    out = out.index_add(0, rows.nonzero()[:, 0], swiglu(wk * x[rows], w1[e], w2[e]))
                else:
                    out = out.index_add(0, rows.nonzero()[:, 0], wk * swiglu(x[rows], w1[e], w2[e]))
        f = torch.bincount(idx.reshape(-1), minlength=p.E).double() / (p.T * p.K)
        aux = aux_coeff * p.E * (f * prob.mean(0)).sum()
        z = z_coeff * (torch.logsumexp(logits, dim=1) ** 2).mean()
        total = total + (out * g).sum() + aux + z
        outs.append(out.detach())
        losses.append(float(aux + z))
    total.backward()
    return dict(out=outs, grad_x=[x.grad for x in xs], router=router.grad, w1=w1.grad,
                w2=w2.grad, losses=losses)


def make_layer(comm, p, weighting, device="cpu", **kw):
    El = p.E // comm.size
    m = et.MoE(comm, p.H, p.F, p.E, p.K, max_tokens_per_rank=p.T, dtype=p.dtype, device=device,
               weighting=weighting, **kw)
    lo = comm.rank * El
    with torch.no_grad():
        m.router.weight.copy_(p.router.float())
        m.w_gate_up.copy_(p.w1[lo:lo + El].transpose(1, 2).to(p.dtype))
        m.w_down.copy_(p.w2[lo:lo + El].transpose(1, 2).to(p.dtype))
    return m


def layer_step(comm, p, weighting, device="cpu", checkpoint=False, compile_backend=None, **kw):
    """One forward + backward of the layer on this rank: returns float64 CPU
    copies of out, the gradients, the aux loss, and the recorder stats of a
    checkpointed run."""
    m = make_layer(comm, p, weighting, device, **kw)
    x = p.x[comm.rank].to(device=device, dtype=p.dtype).requires_grad_(True)
    g = p.g[comm.rank].to(device=device, dtype=torch.float32)
    scopes = []

    def context():
        fwd, rec = et.checkpoint_context()
        scopes.append(rec)
        return fwd, rec
    layer = torch.compile(m, fullgraph=True, backend=compile_backend) if compile_backend else m
    if checkpoint:
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=context)
    else:
        out = layer(x)
    loss = (out.float() * g).sum() + m.aux_loss
    loss.backward()
    res = dict(out=out, grad_x=x.grad, router=m.router.weight.grad, w1=m.w_gate_up.grad,
               w2=m.w_down.grad, aux=m.aux_loss, loss=loss)
    res = {k: v.detach().double().cpu() for k, v in res.items()}
    res["stats"] = scopes[0].stats if scopes else None
    del out, loss
    m.buffer.close()
    return res


def close(got, ref, tol, what):
    """|got - ref| <= tol[0] * max(1, max|ref|) + tol[1] * |ref|: the
    absolute part scales with the tensor (a bf16 sum over many rows)."""
    got, ref = (np.asarray(a.numpy() if hasattr(a, "numpy") else a, dtype=np.float64)
                for a in (got, ref))
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    assert_close(got, ref, tol[0] * scale, tol[1], what)


def check_against_reference(res, ref, p, tol):
    El = p.E // p.W
    router = sum(r["router"] for r in res)
    assert router.abs().max() > 0, "the router got no gradient [EPX_TEST_SEED=%d]" % SEED
    close(router, ref["router"], tol, "router grad")
    for rank, r in enumerate(res):
        lo = rank * El
        close(r["out"], ref["out"][rank], tol, "out rank %d" % rank)
        close(r["grad_x"], ref["grad_x"][rank], tol, "grad_x %d" % rank)
        close(r["w1"], ref["w1"][lo:lo + El].transpose(1, 2), tol, "w1 grad %d" % rank)
        close(r["w2"], ref["w2"][lo:lo + El].transpose(1, 2), tol, "w2 grad %d" % rank)
        close(float(r["aux"]), ref["losses"][rank], tol, "aux+z loss %d" % rank)


def run_layer(W, p, weighting, **kw):
    return epx.run_local(W, layer_step, p, weighting, timeout_seconds=TIMEOUT, **kw)


# ---------------------------------------------------------------------------
# Parity with the plain PyTorch MoE
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("weighting", [W_.IN_COMBINE, W_.IN_DISPATCH, W_.NONE])
def test_layer_matches_pytorch_moe(W, weighting):
    """Forward and every gradient, the router's included, in every weighting."""
    p = Problem(SEED, W, T=24, H=16, F=8, E=8, K=2)
    res = run_layer(W, p, weighting, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    ref = reference(p, weighting, aux_coeff=0.01, z_coeff=0.001)
    check_against_reference(res, ref, p, (1e-5, 1e-4))


@pytest.mark.parametrize("exchange", [epx.Exchange.DEDUP, epx.Exchange.COLLECTIVE])
def test_layer_bf16_and_exchanges_agree(exchange):
    """bf16 payloads and expert weights (router in float32) against the
    float64 reference, and both exchanges give the same bits."""
    p = Problem(SEED, 2, T=32, H=16, F=16, E=8, K=3, dtype=torch.bfloat16)
    res = run_layer(2, p, W_.IN_COMBINE, exchange=exchange)
    check_against_reference(res, reference(p, W_.IN_COMBINE), p, (3e-2, 3e-2))
    other = run_layer(2, p, W_.IN_COMBINE, exchange=epx.Exchange.DEDUP)
    for a, b in zip(res, other):
        for k in ("out", "grad_x", "router", "w1", "w2"):
            assert torch.equal(a[k], b[k]), "%s differs between exchanges" % k


def test_capacity_layout_and_aligned_groups():
    """Capacity routing in the capacity layout, and dropless routing with
    groups padded for a grouped GEMM: the same results as the reference
    when nothing is dropped (a capacity factor of E/K keeps every route)."""
    p = Problem(SEED, 2, T=16, H=16, F=8, E=4, K=2)
    ref = reference(p, W_.IN_COMBINE)
    res = run_layer(2, p, W_.IN_COMBINE, layout=epx.Layout.CAPACITY, capacity_factor=2.0)
    check_against_reference(res, ref, p, (1e-5, 1e-4))
    res = run_layer(2, p, W_.IN_COMBINE, expert_alignment=8)
    check_against_reference(res, ref, p, (1e-5, 1e-4))


# ---------------------------------------------------------------------------
# The functional API: worst-case sizes, device counts, recv_w's gradient
# ---------------------------------------------------------------------------


def test_dispatch_sizes_for_the_worst_case_and_keeps_counts_on_device():
    T, H, E, K = 20, 16, 8, 2

    def rank(comm):
        g = torch.Generator().manual_seed(SEED + comm.rank)
        logits = torch.randn(T, E, generator=g, requires_grad=True)
        x = torch.randn(T, H, generator=g)
        buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                             dtype=torch.float32)
        r = et.route(logits, top_k=K)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w, weighting=W_.NONE)
        n = d.recv_rows_host()
        assert d.recv_x.shape == (buf.max_recv_rows(), H)
        assert d.recv_rows.dtype == torch.int64 and d.counts.dtype == torch.int64
        assert sum(d.counts_host()) == n == int(d.offsets[-1]) == d.handle().recv_rows
        assert torch.all(d.recv_x[n:] == 0) and torch.all(d.recv_expert[n:] == -1)
        # Weighting.NONE: the expert applies recv_w; its gradient reaches the logits
        scale = torch.where(d.recv_expert >= 0, 0.5 + d.recv_expert.double() / E, 0.0).float()
        out = et.combine(d, d.recv_x * (d.recv_w * scale)[:, None])
        out.sum().backward()
        assert logits.grad is not None and logits.grad.abs().max() > 0
        # the same gradient as weights applied in combine (a linear expert)
        logits2 = logits.detach().clone().requires_grad_(True)
        r2 = et.route(logits2, top_k=K)
        d2 = et.dispatch(buf, x, r2.topk_idx, r2.topk_w)
        et.combine(d2, d2.recv_x * scale[:, None]).sum().backward()
        assert_close(logits.grad.numpy(), logits2.grad.numpy(), 1e-6, 1e-5, "NONE vs IN_COMBINE")
        del d, d2, out
        buf.close()
        return True
    assert epx.run_local(2, rank, timeout_seconds=TIMEOUT) == [True, True]


def test_token_dispatcher_megatron_shape():
    """token_permutation(hidden, probs, routing_map) / token_unpermutation:
    the weighted sum of the experts, with the gradient into probs."""
    S, B, H, E, K = 4, 3, 16, 8, 2

    def rank(comm):
        g = torch.Generator().manual_seed(SEED + comm.rank)
        hidden = torch.randn(S, B, H, generator=g, requires_grad=True)
        logits = torch.randn(S * B, E, generator=g, requires_grad=True)
        probs = torch.softmax(logits, dim=1)
        top = torch.topk(probs, K, dim=1).indices
        routing_map = torch.zeros(S * B, E, dtype=torch.bool).scatter(1, top, True)
        disp = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=S * B)
        tokens, tpe = disp.token_permutation(hidden, probs, routing_map)
        assert tpe.shape == (E // comm.size,) and sum(disp.tokens_per_expert_host()) > 0
        first = comm.rank * (E // comm.size)
        d = disp._d
        scale = torch.where(d.recv_expert >= 0, 1.0 + d.recv_expert.float(), 0.0)
        out, bias = disp.token_unpermutation(tokens * scale[:, None])
        assert bias is None and out.shape == hidden.shape
        ref = ((probs * routing_map) * (1.0 + torch.arange(E).float())).sum(1).detach()
        assert first >= 0
        assert_close(out.detach().reshape(-1, H).numpy(),
                     (ref[:, None] * hidden.detach().reshape(-1, H)).numpy(), 1e-5, 1e-5,
                     "dispatcher out")
        out.sum().backward()
        assert logits.grad.abs().max() > 0 and hidden.grad is not None
        ref_logits = logits.detach().clone().requires_grad_(True)
        p2 = torch.softmax(ref_logits, 1)
        (((p2 * routing_map) * (1.0 + torch.arange(E).float())).sum(1)[:, None]
         * hidden.detach().reshape(-1, H)).sum().backward()
        assert_close(logits.grad.numpy(), ref_logits.grad.numpy(), 1e-5, 1e-4, "probs grad")
        del tokens, out, d
        disp.buffer.close()
        return True
    assert epx.run_local(2, rank, timeout_seconds=TIMEOUT) == [True, True]


# ---------------------------------------------------------------------------
# Checkpoint replay and torch.compile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", [1, 2])
def test_checkpoint_replays_the_handles_bit_identically(W):
    p = Problem(SEED, W, T=24, H=16, F=8, E=8, K=2)
    plain = run_layer(W, p, W_.NONE, aux_loss_coeff=0.01)
    ckpt = run_layer(W, p, W_.NONE, aux_loss_coeff=0.01, checkpoint=True)
    for a, b in zip(plain, ckpt):
        for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
            assert torch.equal(a[k], b[k]), "%s differs under checkpoint replay" % k
        s = b["stats"]
        assert (s.records, s.replays, s.fallbacks) == (1, 1, 0), s


def test_compile_traces_the_layer_without_graph_breaks():
    """fullgraph=True fails on any graph break; aot_eager runs the traced
    forward and backward graphs with the same kernels as eager, so the bits
    must match."""
    p = Problem(SEED, 1, T=24, H=16, F=8, E=8, K=2)
    eager = run_layer(1, p, W_.NONE, aux_loss_coeff=0.01)
    torch._dynamo.reset()
    compiled = run_layer(1, p, W_.NONE, aux_loss_coeff=0.01, compile_backend="aot_eager")
    for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
        assert torch.equal(eager[0][k], compiled[0][k]), "%s differs when compiled" % k


def test_compile_traces_the_memory_fields_too():
    """The padding mask and the global aux loss's counts, given to forward as
    tensors, trace without a graph break and give the eager bits."""
    p = Problem(SEED, 1, T=24, H=16, F=8, E=8, K=2)
    mask = torch.arange(p.T) % 4 != 1
    counts = torch.arange(1, p.E + 1, dtype=torch.float32) * 3
    with epx.Comm.create_self() as comm:
        m = make_layer(comm, p, W_.IN_COMBINE, aux_loss_coeff=0.01, aux_loss_tokens=4.0 * p.T)
        x = p.x[0].float()

        def step(inp):
            out = m(inp, token_mask=mask, aux_loss_expert_counts=counts)
            return out, m.aux_loss

        want = step(x)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
        assert want[1].item() > 0
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        del want, got  # their autograd graphs hold the handles
        m.aux_loss = None
        m.buffer.close()


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_errors_are_python_exceptions_of_their_status():
    T, H, E, K = 8, 16, 4, 2
    logits = torch.randn(T, E, requires_grad=True)
    x = torch.randn(T, H, requires_grad=True)
    with pytest.raises(ValueError) as e:  # epx.InvalidArgumentError
        et.route(logits, top_k=5)
    assert isinstance(e.value, epx.InvalidArgumentError) and "top_k" in str(e.value)
    r = et.route(logits, top_k=K)
    with epx.Comm.create_self() as comm:
        buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                             dtype=torch.bfloat16)
        assert buf.dtype == epx.DType.BFLOAT16
        with pytest.raises(epx.InvalidArgumentError, match="x has dtype torch.float32"):
            et.dispatch(buf, x, r.topk_idx, r.topk_w)
        with pytest.raises(epx.CapacityExceededError, match="max_tokens_per_rank") as e:
            et.dispatch(buf, torch.randn(T + 1, H).bfloat16(), torch.zeros(T + 1, K).int(),
                        torch.ones(T + 1, K))
        assert isinstance(e.value, ValueError)
        bad = r.topk_idx.clone()
        bad[3, 1] = E
        with pytest.raises(epx.InvalidArgumentError, match=r"topk_idx\[3\]\[1\]"):
            et.dispatch(buf, x.bfloat16(), bad, r.topk_w)
        d = et.dispatch(buf, x.bfloat16(), r.topk_idx, r.topk_w)
        out = et.combine(d, d.recv_x * 2)
        del d
        # autograd still holds the handle: close refuses, and names the way out
        with pytest.raises(epx.BusyError, match="run the backward"):
            buf.close()
        assert not buf.closed
        out.float().sum().backward()
        del out
        buf.close()
        with pytest.raises(epx.InvalidHandleError):
            et.dispatch(buf, x.bfloat16(), r.topk_idx, r.topk_w)
        with pytest.raises(TypeError, match="not an epx dtype"):
            comm.buffer(hidden=H, num_experts=E, max_top_k=K, dtype=torch.int8)
        # a torch dtype wherever an epx dtype goes
        with comm.buffer(hidden=H, num_experts=E, max_top_k=K, dtype=torch.bfloat16) as b16:
            assert b16.dtype == epx.DType.BFLOAT16 and b16.np_dtype == np.uint16
        assert epx.dtype_size(torch.float16) == 2 and et.torch_dtype(epx.DType.FLOAT16) is \
            torch.float16


def test_keep_handles_outlives_the_backward():
    """What a CUDA graph needs: handles dispatched under keep_handles stay
    alive after the backward that would release them (the buffer stays busy
    until the list goes)."""
    T, H, E, K = 8, 16, 4, 2
    with epx.Comm.create_self() as comm:
        buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T)
        x = torch.randn(T, H, requires_grad=True)
        r = et.route(torch.randn(T, E), top_k=K)
        with et.keep_handles() as kept:
            d = et.dispatch(buf, x, r.topk_idx, r.topk_w)
            et.combine(d, d.recv_x).sum().backward()
        del d
        assert len(kept) == 1 and not kept[0].released
        with pytest.raises(epx.BusyError):
            buf.close()
        del kept
        buf.close()


def test_a_missing_peer_is_a_timeout_error():
    timed_out = threading.Event()

    def rank(comm):
        buf = et.make_buffer(comm, hidden=16, num_experts=4, max_top_k=1, max_tokens_per_rank=4)
        if comm.rank == 0:
            try:
                et.dispatch(buf, torch.randn(4, 16), torch.zeros(4, 1, dtype=torch.int32),
                            torch.ones(4, 1))
            finally:
                timed_out.set()
        else:
            timed_out.wait(60.0)  # alive but not calling until rank 0 has given up
    with pytest.raises(TimeoutError) as e:
        epx.run_local(2, rank, timeout_seconds=3.0)
    assert isinstance(e.value, epx.TimeoutError) and "rank 1" in e.value.message


def test_replay_mismatch_raises_its_class():
    T, H, E, K = 8, 16, 4, 2
    with epx.Comm.create_self() as comm:
        buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T)
        rec = epx.Recorder(validate=True)
        idx = torch.tensor([[0, 1]] * T, dtype=torch.int32)
        w = torch.full((T, K), 0.5)
        x = torch.randn(T, H)
        et.dispatch(buf, x, idx, w, recorder=rec)
        rec.replay()
        with pytest.raises(epx.ReplayMismatchError, match="call 0"):
            et.dispatch(buf, x, idx.flip(1).contiguous(), w, recorder=rec)
        rec.close()
        buf.close()


def test_comm_from_process_group_on_a_gloo_group_without_mpirun(tmp_path):
    """A gloo group not started by mpirun gets the shm transport; transport
    'mpi' there is refused saying how to launch, an unknown one by name."""
    code = (
        "import os, torch.distributed as dist, epx, epx.torch as et\n"
        "for v in %r: os.environ.pop(v, None)\n"
        "try:\n"
        "    et.comm_from_process_group()\n"
        "except epx.InvalidArgumentError as e: print('uninit', 'init_process_group' in str(e))\n"
        "dist.init_process_group('gloo', init_method='file://%s', rank=0, world_size=1)\n"
        "c = et.comm_from_process_group(); print('shm', c.size); c.close()\n"
        "try:\n"
        "    et.comm_from_process_group(transport='mpi')\n"
        "except epx.UnsupportedError as e: print('mpi', 'mpirun -np 1' in str(e))\n"
        "try:\n"
        "    et.comm_from_process_group(transport='tcp')\n"
        "except epx.InvalidArgumentError as e: print('tcp', \"'shm'\" in str(e))\n"
        "dist.destroy_process_group()\n" % (et._MPI_LAUNCH_VARS, tmp_path / "store"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_child_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["uninit", "True", "shm", "1", "mpi", "True", "tcp", "True"], \
        run.stdout + run.stderr


# ---------------------------------------------------------------------------
# MPI processes: a gloo process group under mpirun
# ---------------------------------------------------------------------------


def _child_env(**extra):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", EPX_LIBRARY=epx.library_path,
               PYTHONPATH=os.pathsep.join([str(REPO / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def mpi_layer_worker(out_dir, seed, W, hide_mpi4py):
    """One rank of test_layer_over_a_gloo_group_under_mpirun."""
    import torch.distributed as dist
    if hide_mpi4py:
        sys.modules["mpi4py"] = None  # the ctypes path to MPI_COMM_WORLD
    et.init_process_group("gloo")  # the rank and size from mpirun's variables
    rank = dist.get_rank()
    comm = et.comm_from_process_group(timeout_seconds=TIMEOUT, transport="mpi")
    assert (comm.rank, comm.size) == (rank, W)
    p = Problem(seed, W, T=24, H=16, F=8, E=8, K=2)
    res = layer_step(comm, p, W_.NONE, aux_loss_coeff=0.01)
    torch.save({k: v for k, v in res.items() if k != "stats"},
               os.path.join(out_dir, "rank%d.pt" % rank))
    comm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("W,hide_mpi4py", [(2, False), (4, False), (2, True)])
def test_layer_over_a_gloo_group_under_mpirun(tmp_path, W, hide_mpi4py):
    """comm_from_process_group(transport="mpi") on a gloo group under mpirun
    -np W, initialised by et.init_process_group with no variables mapped
    (through mpi4py, and through the MPI libepx links): the same bits as the
    local transport."""
    mpiexec = shutil.which("mpiexec")
    if not (mpiexec and epx.has_mpi()):
        pytest.skip("needs mpiexec and a libepx built with MPI")
    if not hide_mpi4py:
        pytest.importorskip("mpi4py")
    command = [mpiexec, "-n", str(W), sys.executable, __file__, "mpi-layer-worker",
               str(tmp_path), str(SEED), str(W), str(int(hide_mpi4py))]
    run = subprocess.run(command, env=_child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, "mpiexec failed:\n%s\n%s" % (run.stdout, run.stderr)
    p = Problem(SEED, W, T=24, H=16, F=8, E=8, K=2)
    local = run_layer(W, p, W_.NONE, aux_loss_coeff=0.01)
    for rank in range(W):
        got = torch.load(tmp_path / ("rank%d.pt" % rank))
        for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
            assert torch.equal(got[k], local[rank][k]), "rank %d: %s differs (MPI vs local)" % (
                rank, k)


# ---------------------------------------------------------------------------
# The routing options through epx.torch (issue 9's, from the layer's router)
# ---------------------------------------------------------------------------


def test_torch_route_takes_every_option_and_the_memory_fields_as_tensors():
    """et.route with group-limited sigmoid scores, a sequence-level aux
    loss, a padding mask and the global aux loss's counts (tensors), against
    the float64 reference: forward and logits.grad."""
    T, E, K = 32, 16, 4
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(T, E, generator=g).requires_grad_(True)
    mask = torch.rand(T, generator=g) > 0.25
    counts = torch.randint(0, 9, (E,), generator=g).float()
    fields = dict(top_k=K, score_fn=epx.ScoreFn.SIGMOID, num_groups=4, topk_groups=2,
                  group_score_experts=2, aux_loss_coeff=0.01, aux_loss_sequences=2,
                  renormalize_after_drop=0, capacity_mode=1,
                  capacity_arithmetic=epx.CapacityArithmetic.FLOAT64, capacity_factor_f64=1.3,
                  drop_policy=epx.DropPolicy.BY_SCORE)
    r = et.route(logits, token_mask=mask, **fields)
    ref = epx.reference_route(logits.detach().numpy(), token_mask=mask.numpy(), **fields)
    assert np.array_equal(r.topk_idx.numpy(), ref.topk_idx) and int(r.capacity) == ref.capacity
    assert_close(r.topk_w.detach().numpy(), ref.topk_w, 1e-6, 1e-5, "topk_w")
    assert_close(r.aux_loss.item(), ref.aux_loss, 1e-7, 1e-5, "aux_loss")
    gw = torch.randn(T, K, generator=g)
    ((r.topk_w * gw).sum() + 3.0 * r.aux_loss).backward()
    want = epx.reference_route_backward(logits.detach().numpy(), ref.topk_idx,
                                        gw.numpy(), token_mask=mask.numpy(),
                                        grad_aux_loss=3.0, **fields)
    assert_close(logits.grad.numpy(), want, 1e-6, 1e-4, "logits.grad")
    assert logits.grad[~mask].abs().max() == 0  # padding gets no gradient
    # The global aux loss: the counts as a tensor, aux_loss_tokens a field.
    glob = et.route(logits.detach(), top_k=K, aux_loss_coeff=0.1, aux_loss_expert_counts=counts,
                    aux_loss_tokens=4.0 * T)
    gref = epx.reference_route(logits.detach().numpy(), top_k=K, aux_loss_coeff=0.1,
                               aux_loss_expert_counts=counts.numpy(), aux_loss_tokens=4.0 * T)
    assert_close(float(glob.aux_loss), gref.aux_loss, 1e-7, 1e-5, "global aux_loss")
    with pytest.raises(ValueError, match="stream is memory"):
        et.route(logits, top_k=K, stream=0)
    with pytest.raises(ValueError, match="token_mask / aux_loss_expert_counts are set"):
        et.route(logits, epx.RouteConfig(num_experts=E, top_k=K, token_mask=1024))


def test_moe_router_takes_every_route_config_field():
    """Each field of epx.RouteConfig but those the layer sets is a keyword of
    epx.torch.MoE (or comes in route_config); the memory fields are
    forward's arguments."""
    fixed = ("struct_size", "version") + et._MOE_FIXED
    names = [f[0] for f in epx.RouteConfig._fields_ if f[0] not in fixed]
    values = dict(score_fn=epx.ScoreFn.SIGMOID, num_groups=4, topk_groups=2, renormalize=True,
                  scaling_factor=2.0, min_capacity=3, queue_order=epx.QueueOrder.BY_TOKEN,
                  drop_policy=epx.DropPolicy.BY_RANDOM_PRIORITY, aux_loss_coeff=2.0 ** -6,
                  z_loss_coeff=2.0 ** -9, nonfinite=epx.Nonfinite.DROP,
                  capacity_arithmetic=epx.CapacityArithmetic.FLOAT64, capacity_factor=1.5,
                  capacity_factor_f64=2.5, renormalize_after_drop=1, group_score_experts=1,
                  aux_counts=epx.AuxCounts.FIRST_CHOICE, aux_loss_sequences=2,
                  aux_loss_tokens=64.0, random_seed=99)
    assert sorted(names) == sorted(values)
    with epx.Comm.create_self() as comm:
        kw = {k: v for k, v in values.items() if k not in ("capacity_factor", "capacity_factor_f64")}
        m = et.MoE(comm, 16, 8, 8, 2, max_tokens_per_rank=16, capacity_factor=2.5,
                   layout=epx.Layout.CAPACITY, **kw)
        c = m.route_config
        for k, v in kw.items():
            assert getattr(c, k) == v, k
        # capacity_factor goes where the arithmetic reads it; the buffer's C is route's
        assert (c.capacity_mode, c.capacity_factor_f64, c.capacity_factor) == (1, 2.5, 1.0)
        assert m.buffer.config.capacity == epx.route(np.zeros((16, 8), np.float32), c).capacity
        base = epx.RouteConfig(num_experts=8, top_k=2, score_fn=epx.ScoreFn.SQRT_SOFTPLUS,
                               z_loss_coeff=0.5)
        m2 = et.MoE(comm, 16, 8, 8, 2, max_tokens_per_rank=16, route_config=base,
                    z_loss_coeff=0.25)
        assert (m2.route_config.score_fn, m2.route_config.z_loss_coeff) == (
            epx.ScoreFn.SQRT_SOFTPLUS, 0.25)
        with pytest.raises(TypeError, match="no settable field"):
            et.MoE(comm, 16, 8, 8, 2, max_tokens_per_rank=16, score_function=1)
        with pytest.raises(ValueError, match="pass it to forward"):
            et.MoE(comm, 16, 8, 8, 2, max_tokens_per_rank=16, token_mask=None)
        for layer in (m, m2):
            layer.buffer.close()


def test_moe_forward_with_a_padding_mask():
    """Padding tokens (token_mask False) route nowhere: zero output, no
    gradient, no aux loss share; the real tokens as without padding."""
    p = Problem(SEED, 1, T=24, H=16, F=8, E=8, K=2)
    with epx.Comm.create_self() as comm:
        m = make_layer(comm, p, W_.IN_COMBINE, aux_loss_coeff=0.01)
        mask = torch.arange(p.T) % 4 != 1
        x = p.x[0].float().requires_grad_(True)
        out = m(x, token_mask=mask)
        aux = m.aux_loss
        (out.sum() + aux).backward()
        assert out[~mask].abs().max() == 0 and x.grad[~mask].abs().max() == 0
        xs = p.x[0].float()[mask].requires_grad_(True)
        alone = m(xs)
        assert torch.allclose(out[mask], alone, atol=1e-6, rtol=1e-5)
        assert aux.item() > 0 and torch.allclose(aux, m.aux_loss, rtol=1e-5)
        (alone.sum() + m.aux_loss).backward()
        assert torch.allclose(x.grad[mask], xs.grad, atol=1e-6, rtol=1e-5)
        m.buffer.close()


# ---------------------------------------------------------------------------
# GPU (skipped without a GPU and a CUDA libepx)
# ---------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and a libepx built with EPX_BUILD_CUDA")


@gpu
@pytest.mark.parametrize("weighting", [W_.IN_COMBINE, W_.NONE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layer_matches_pytorch_moe(weighting, dtype):
    p = Problem(SEED, 1, T=64, H=64, F=32, E=8, K=2, dtype=dtype)
    res = run_layer(1, p, weighting, device="cuda", aux_loss_coeff=0.01)
    tol = (3e-2, 3e-2) if dtype == torch.bfloat16 else (1e-4, 1e-3)
    check_against_reference(res, reference(p, weighting, aux_coeff=0.01), p, tol)


@gpu
def test_gpu_checkpoint_and_compile():
    p = Problem(SEED, 1, T=64, H=64, F=32, E=8, K=2, dtype=torch.bfloat16)
    plain = run_layer(1, p, W_.NONE, device="cuda")
    ckpt = run_layer(1, p, W_.NONE, device="cuda", checkpoint=True)
    torch._dynamo.reset()
    compiled = run_layer(1, p, W_.NONE, device="cuda", compile_backend="aot_eager")
    for k in ("loss", "out", "grad_x", "router", "w1", "w2"):
        assert torch.equal(plain[0][k], ckpt[0][k]), "%s differs under checkpoint replay" % k
        assert torch.equal(plain[0][k], compiled[0][k]), "%s differs when compiled" % k


@gpu
def test_gpu_cuda_graph_replays_a_layer_step_bit_identically():
    """A whole layer step (forward, backward) captured once in a CUDA graph
    and replayed on new inputs copied into the static ones: the same bits as
    eager steps on those inputs."""
    p = Problem(SEED, 1, T=64, H=64, F=32, E=8, K=2, dtype=torch.bfloat16)
    with epx.Comm.create_self() as comm:
        m = make_layer(comm, p, W_.NONE, device="cuda")
        params = [m.router.weight, m.w_gate_up, m.w_down]
        x = torch.zeros(p.T, p.H, device="cuda", dtype=p.dtype, requires_grad=True)
        g = torch.zeros(p.T, p.H, device="cuda")

        def step():
            for q in params + [x]:
                q.grad = None
            loss = (m(x).float() * g).sum()
            loss.backward()
            return loss

        def eager_result(i):
            with torch.no_grad():
                x.copy_(p.x[0].to(p.dtype) * (1 + i))
                g.copy_(p.g[0].float())
            loss = step()
            return [loss.detach().clone()] + [q.grad.clone() for q in params + [x]]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up on the capture stream (allocations, lazy init)
                eager_result(0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for q in params + [x]:
            q.grad = None
        with et.keep_handles() as kept, torch.cuda.graph(graph, stream=side):
            static_loss = step()
        assert len(kept) == 1
        static = [static_loss] + [q.grad for q in params + [x]]
        for i in range(3):
            with torch.no_grad():
                x.copy_(p.x[0].to(p.dtype) * (1 + i))
                g.copy_(p.g[0].float())
            graph.replay()
            torch.cuda.synchronize()
            got = [t.clone() for t in static]
            want = eager_result(i)
            for a, b in zip(got, want):
                assert torch.equal(a, b), "graph replay %d differs from eager" % i
        del graph, static, static_loss, kept
        m.buffer.close()


@gpu
@pytest.mark.parametrize("case", [
    dict(score_fn=epx.ScoreFn.SIGMOID, num_groups=4, topk_groups=2, scaling_factor=1.5,
         z_loss_coeff=0.01),
    dict(capacity_mode=1, capacity_arithmetic=epx.CapacityArithmetic.FLOAT64,
         capacity_factor_f64=1.1, drop_policy=epx.DropPolicy.BY_RANDOM_PRIORITY, random_seed=7,
         renormalize_after_drop=1, aux_counts=epx.AuxCounts.FIRST_CHOICE),
])
def test_gpu_route_options_and_padding_mask_match_the_reference(case):
    """CUDA routing with the options, a device padding mask and device
    global-aux counts against the float64 reference, forward and logits.grad."""
    T, E, K = 64, 16, 2
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(T, E, generator=g)
    mask = torch.rand(T, generator=g) > 0.25
    counts = torch.randint(0, 9, (E,), generator=g).float()
    fields = dict(case, top_k=K, aux_loss_coeff=0.01, nonfinite=epx.Nonfinite.DROP)
    lc = logits.cuda().requires_grad_(True)
    r = et.route(lc, token_mask=mask.cuda(), aux_loss_expert_counts=counts.cuda(),
                 aux_loss_tokens=2.0 * T, **fields)
    ref = epx.reference_route(logits.numpy(), token_mask=mask.numpy(),
                              aux_loss_expert_counts=counts.numpy(), aux_loss_tokens=2.0 * T,
                              **fields)
    assert np.array_equal(r.topk_idx.cpu().numpy(), ref.topk_idx)
    assert_close(r.topk_w.detach().cpu().numpy(), ref.topk_w, 1e-6, 1e-5, "topk_w")
    assert_close(r.aux_loss.item(), ref.aux_loss, 1e-7, 1e-5, "aux_loss")
    gw = torch.randn(T, K, generator=g)
    ((r.topk_w * gw.cuda()).sum() + 2.0 * r.aux_loss).backward()
    want = epx.reference_route_backward(logits.numpy(), ref.topk_idx, gw.numpy(),
                                        token_mask=mask.numpy(),
                                        aux_loss_expert_counts=counts.numpy(),
                                        aux_loss_tokens=2.0 * T, grad_aux_loss=2.0, **fields)
    assert_close(lc.grad.cpu().numpy(), want, 1e-6, 1e-4, "logits.grad")


def gpu_worker(rank, W, seed, out_dir, port):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=W)
    comm = et.comm_from_process_group(timeout_seconds=TIMEOUT)
    p = Problem(seed, W, T=64, H=64, F=32, E=8, K=2, dtype=torch.bfloat16)
    res = layer_step(comm, p, W_.IN_COMBINE, device="cuda", aux_loss_coeff=0.01)
    torch.save({k: v for k, v in res.items() if k != "stats"},
               os.path.join(out_dir, "rank%d.pt" % rank))
    comm.close()
    dist.destroy_process_group()


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not epx.has_nccl(),
                    reason="needs 2 GPUs and a libepx with NCCL")
def test_gpu_two_ranks_over_an_nccl_group_match_pytorch_moe(tmp_path):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(gpu_worker, args=(2, SEED, str(tmp_path), port), nprocs=2, join=True)
    p = Problem(SEED, 2, T=64, H=64, F=32, E=8, K=2, dtype=torch.bfloat16)
    res = [torch.load(tmp_path / ("rank%d.pt" % r)) for r in range(2)]
    check_against_reference(res, reference(p, W_.IN_COMBINE, aux_coeff=0.01), p, (3e-2, 3e-2))


if __name__ == "__main__" and sys.argv[1:2] == ["mpi-layer-worker"]:
    mpi_layer_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])))
