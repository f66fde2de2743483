"""epx.torch's overlap hooks, exact-size outputs and handle reuse: events in
and out of dispatch and combine (DeepEP's previous_event / async_finish /
EventOverlap), a dispatch again on an earlier dispatch's handle, receive
tensors of exactly N rows, profiler ranges and stats(). Each is checked
against the plain (worst-case, current-stream) ops on the same inputs, on 1
and 2 ranks (threads of the local transport). The GPU test overlaps a matmul
with a dispatch on epx's communication stream; it skips without a GPU.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_torch_overlap.py
"""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402

W_ = epx.Weighting
T, H, E, K = 20, 16, 8, 2
HAS_GPU = torch.cuda.is_available() and epx.has_cuda()
torch.set_num_threads(1)


def inputs(rank, device="cpu"):
    g = torch.Generator().manual_seed(SEED + 101 * rank)
    logits = torch.randn(T, E, generator=g)
    x = torch.randn(T, H, generator=g)
    grad = torch.randn(T, H, generator=g)
    return logits.to(device), x.to(device), grad.to(device)


def step(buf, logits, x, grad, weighting=W_.IN_COMBINE, **kw):
    """route, dispatch (with kw), a linear expert, combine, backward ->
    (the Dispatched, out, x.grad, logits.grad)."""
    logits = logits.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    r = et.route(logits, top_k=K)
    d = et.dispatch(buf, x, r.topk_idx, r.topk_w, weighting=weighting, **kw)
    if d.event is not None:
        d.event.current_stream_wait()
    scale = torch.where(d.recv_expert >= 0, 0.5 + d.recv_expert.float() / E, 0.0)
    expert_out = d.recv_x * scale[:, None]
    if weighting == W_.NONE:
        expert_out = expert_out * d.recv_w[:, None]
    out = et.combine(d, expert_out)
    (out * grad).sum().backward()
    return d, out.detach(), x.grad, logits.grad


def make(comm, device="cpu"):
    return et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                          device=device)


@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("weighting", [W_.IN_COMBINE, W_.IN_DISPATCH, W_.NONE])
def test_exact_size_outputs_are_the_worst_case_ones_cut_to_n(W, weighting):
    def rank(comm):
        logits, x, grad = inputs(comm.rank)
        with make(comm) as buf:
            d, out, gx, gl = step(buf, logits, x, grad, weighting)
            e, out_e, gx_e, gl_e = step(buf, logits, x, grad, weighting, exact_size=True)
            n = d.recv_rows_host()
            assert d.recv_x.shape[0] == buf.max_recv_rows() >= n
            assert e.recv_x.shape == (n, H) and e.recv_w.shape == (n,)
            assert e.recv_expert.shape == (n,) and e.recv_rows_host() == n
            for a, b in ((d.recv_x[:n], e.recv_x), (d.recv_w[:n], e.recv_w),
                         (d.recv_expert[:n], e.recv_expert), (d.counts, e.counts),
                         (d.offsets, e.offsets), (out, out_e), (gx, gx_e), (gl, gl_e)):
                assert torch.equal(a, b)
            del d, e
        return True
    assert epx.run_local(W, rank, timeout_seconds=TIMEOUT) == [True] * W


@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("weighting", [W_.IN_COMBINE, W_.IN_DISPATCH])
def test_dispatch_again_on_a_handle_is_a_fresh_dispatch_of_the_same_routing(W, weighting):
    def rank(comm):
        logits, x, grad = inputs(comm.rank)
        x2 = x.flip(0).contiguous() * 3 - 1
        with make(comm) as buf:
            r = et.route(logits, top_k=K)
            d = et.dispatch(buf, x, r.topk_idx, r.topk_w, weighting=weighting)
            leaf = x2.clone().requires_grad_(True)
            again = et.dispatch(buf, leaf, handle=d)
            fresh = et.dispatch(buf, x2, r.topk_idx, r.topk_w, weighting=weighting)
            assert torch.equal(again.recv_x, fresh.recv_x)
            assert again.handle_id is d.handle_id
            # its backward: the gradient of x2 through the same layout
            leaf2 = x2.clone().requires_grad_(True)
            fresh2 = et.dispatch(buf, leaf2, r.topk_idx, r.topk_w.detach(), weighting=weighting)
            g = torch.randn(again.recv_x.shape, generator=torch.Generator().manual_seed(5))
            (again.recv_x * g).sum().backward()
            (fresh2.recv_x * g).sum().backward()
            assert torch.equal(leaf.grad, leaf2.grad)
            # combine on the reused handle
            assert torch.equal(et.combine(again, again.recv_x), et.combine(fresh, fresh.recv_x))
            with pytest.raises(epx.InvalidArgumentError, match="topk_idx given with handle="):
                et.dispatch(buf, x, r.topk_idx, handle=d)
            with pytest.raises(TypeError, match="pass the Dispatched"):
                et.dispatch(buf, x, handle=d.handle_id)
            del d, again, fresh, fresh2
        return True
    assert epx.run_local(W, rank, timeout_seconds=TIMEOUT) == [True] * W


def test_events_on_cpu_are_done_when_the_op_returns():
    def rank(comm):
        logits, x, grad = inputs(comm.rank)
        with make(comm) as buf:
            d, out, gx, gl = step(buf, logits, x, grad)
            a, out_a, gx_a, gl_a = step(buf, logits, x, grad, async_finish=True,
                                        previous_event=et.current_event())
            assert isinstance(a.event, et.EventOverlap) and a.event.query()
            assert d.event is None
            for u, v in ((out, out_a), (gx, gx_a), (gl, gl_a)):
                assert torch.equal(u, v)
            res, ev = et.combine(a, a.recv_x, async_finish=True)
            with ev:
                pass
            assert torch.equal(res, et.combine(a, a.recv_x))
            out2, ev2 = et.combine(a, a.recv_x, return_event=True)
            assert isinstance(ev2, et.EventOverlap) and torch.equal(out2, res)
            with pytest.raises(TypeError, match="previous_event is a"):
                et.combine(a, a.recv_x, previous_event=object())
            with pytest.raises(epx.InvalidArgumentError, match="streams are for CUDA"):
                et.combine(a, a.recv_x, comm_stream=object())
            del d, a, res, out2
        return True
    assert epx.run_local(2, rank, timeout_seconds=TIMEOUT) == [True, True]


def test_every_op_is_a_profiler_range_and_counts_in_stats():
    et.stats(reset=True)
    with epx.Comm.create_self() as comm, make(comm) as buf:
        logits, x, grad = inputs(0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            d, *_ = step(buf, logits, x, grad)
            del d
    names = {e.name for e in prof.events()}
    for op in ("epx::route", "epx::dispatch", "epx::combine", "epx::combine_backward",
               "epx::dispatch_backward", "epx::route_backward"):
        assert op in names, "no profiler range %s in %s" % (op, sorted(n for n in names
                                                                        if "epx" in n))
    s = et.stats()
    assert s["epx::dispatch"]["calls"] == 1 and s["epx::combine"]["calls"] == 1
    assert s["epx::dispatch"]["host_seconds"] > 0
    assert et.stats(reset=True) and et.stats() == {}


def test_exact_size_traces_under_torch_compile():
    with epx.Comm.create_self() as comm, make(comm) as buf:
        logits, x, _ = inputs(0)
        r = et.route(logits, top_k=K)

        def f(x, idx, w):
            d = et.dispatch(buf, x, idx, w, exact_size=True)
            return et.combine(d, d.recv_x * 2)
        want = f(x, r.topk_idx, r.topk_w)
        got = torch.compile(f, backend="eager")(x, r.topk_idx, r.topk_w)
        assert torch.equal(got, want)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and a libepx built with EPX_BUILD_CUDA")
def test_gpu_matmul_overlaps_a_dispatch_on_the_comm_stream():
    """A dispatch launched with async_finish runs on epx's communication
    stream while a matmul issued after it runs on the current stream: both
    results are right, and the current stream waits only where asked."""
    with epx.Comm.create_self() as comm, make(comm, device="cuda") as buf:
        logits, x, grad = inputs(0, "cuda")
        ref, out_ref, gx_ref, gl_ref = step(buf, logits, x, grad)
        a = torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        r = et.route(logits, top_k=K)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w, previous_event=et.current_event(),
                        async_finish=True)
        assert d.event is not None and d.event.event is not None
        c = a @ a                                  # overlaps the dispatch
        with d.event:                              # the current stream waits at the end
            c2 = c @ a
        assert torch.equal(d.recv_x, ref.recv_x)
        out, ev = et.combine(d, d.recv_x, async_finish=True)
        ev.current_stream_wait()
        assert torch.equal(out, et.combine(ref, ref.recv_x))
        torch.testing.assert_close(c2, (a @ a) @ a)
        # the autograd step through the comm stream gives the same gradients
        d2, out2, gx2, gl2 = step(buf, logits, x, grad, async_finish=True)
        torch.cuda.synchronize()
        for u, v in ((out_ref, out2), (gx_ref, gx2), (gl_ref, gl2)):
            assert torch.equal(u, v)
        del ref, d, d2  # every Dispatched dropped before the buffer closes


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and a libepx built with EPX_BUILD_CUDA")
@pytest.mark.parametrize("weighting", [W_.IN_COMBINE, W_.NONE])
def test_gpu_exact_size_outputs_are_the_worst_case_ones_cut_to_n(weighting):
    with epx.Comm.create_self() as comm, make(comm, device="cuda") as buf:
        logits, x, grad = inputs(0, "cuda")
        d, out, gx, gl = step(buf, logits, x, grad, weighting)
        e, out_e, gx_e, gl_e = step(buf, logits, x, grad, weighting, exact_size=True)
        n = d.recv_rows_host()
        assert e.recv_x.shape == (n, H) and d.recv_x.shape[0] == buf.max_recv_rows()
        for a, b in ((d.recv_x[:n], e.recv_x), (d.recv_w[:n], e.recv_w),
                     (d.recv_expert[:n], e.recv_expert), (d.counts, e.counts),
                     (out, out_e), (gx, gx_e), (gl, gl_e)):
            assert torch.equal(a, b)
        del d, e
