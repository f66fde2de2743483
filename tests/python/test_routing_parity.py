"""Routing against DeepSpeed's gating, and epx.torch's routing edges
(issue 28): renormalize_after_drop in dropless mode on the CPU (forward
against the reference and against its own backward), the capacity formula
against a torch reimplementation of DeepSpeed's _capacity over a sweep of
shapes, and the small sharp edges of epx.torch.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python
"""
import gc
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402

HAS_GPU = torch.cuda.is_available() and epx.has_cuda()
DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])


# ---------------------------------------------------------------------------
# renormalize_after_drop in dropless mode (DeepSpeed drop_tokens=False)
# ---------------------------------------------------------------------------


def _issue_logits():
    """The issue's example: torch.manual_seed(11020); randn(16, 4)."""
    torch.manual_seed(11020)
    return torch.randn(16, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_renormalize_after_drop_dropless_forward(device):
    logits = _issue_logits()
    fields = dict(top_k=2, renormalize=1, renormalize_after_drop=1, capacity_mode=0)
    ref = epx.reference_route(logits.numpy(), **fields)
    # The issue's token 14: [0.6199, 0.3801], not the unnormalised [0.3852, 0.2362].
    assert np.allclose(ref.topk_w[14], [0.61992732, 0.38007268], atol=1e-6)
    r = et.route(logits.to(device), **fields)
    np.testing.assert_array_equal(r.topk_idx.cpu().numpy(), ref.topk_idx)
    np.testing.assert_allclose(r.topk_w.cpu().numpy(), ref.topk_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.topk_w.cpu().numpy().sum(1), 1.0, rtol=1e-6)
    if device == "cpu":
        n = epx.route(logits.numpy(), **fields)
        np.testing.assert_allclose(n.topk_w, ref.topk_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_renormalize_after_drop_dropless_backward_agrees(device):
    """The forward's weights differentiated by finite differences (float64)
    equal route_backward's gradient: forward and backward agree."""
    logits = _issue_logits().double()
    fields = dict(top_k=2, renormalize=1, renormalize_after_drop=1, capacity_mode=0)
    g = torch.randn(16, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = logits.float().to(device).requires_grad_(True)
    r = et.route(x, **fields)
    (r.topk_w.double() * g.to(device)).sum().backward()
    grad = x.grad.cpu().double()
    # Central differences of the forward itself (one token at a time keeps
    # every other token's routing fixed; steps small enough to keep this one's).
    step = 1e-3
    fd = torch.zeros_like(logits)
    for t in range(16):
        for e in range(4):
            up, down = logits.clone(), logits.clone()
            up[t, e] += step
            down[t, e] -= step
            wu = et.route(up.float().to(device), **fields)
            wd = et.route(down.float().to(device), **fields)
            assert torch.equal(wu.topk_idx, wd.topk_idx)
            fd[t, e] = ((wu.topk_w.cpu().double() - wd.topk_w.cpu().double()) * g).sum() / (2 * step)
    assert torch.allclose(grad, fd, atol=2e-3, rtol=1e-2), (grad - fd).abs().max()


# ---------------------------------------------------------------------------
# Capacity: DeepSpeed's _capacity, as torch computes it
# ---------------------------------------------------------------------------


def _deepspeed_capacity_eager(num_tokens, num_experts, k, capacity_factor, min_capacity):
    """deepspeed/moe/sharded_moe.py: topkgating calls
    _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
    (top1gating: capacity_factor; top2gating: capacity_factor * 2), and
    _capacity computes
        capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
        if capacity < min_capacity: capacity = min_capacity.to(torch.int64)
    with num_tokens, num_experts = gates.shape."""
    cf = torch.tensor(capacity_factor * k)
    mc = torch.tensor(min_capacity)
    capacity = torch.ceil((num_tokens / num_experts) * cf).to(torch.int64)
    if capacity < mc:
        capacity = mc.to(torch.int64)
    return int(capacity)


def _deepspeed_capacity_body(gates: torch.Tensor, capacity_factor: torch.Tensor,
                                 min_capacity: torch.Tensor) -> torch.Tensor:
    """The same body under torch.jit.script (DeepSpeed scripts _capacity
    where its torch allows)."""
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


SWEEP_FACTORS = (1.0, 1.1, 1.2, 1.25, 1.5, 2.0, 0.5, 0.8, 1.3, 1.75, 3.0)


def test_capacity_issue_example():
    """T=30, E=4, K=3, factor 1.2: DeepSpeed's C is 27 (the float32 field
    alone gives 28)."""
    assert _deepspeed_capacity_eager(30, 4, 3, 1.2, 0) == 27
    fields = dict(num_experts=4, top_k=3, capacity_mode=1, capacity_factor=1.2)
    assert epx.route_capacity(30, **fields) == 27
    logits = torch.randn(30, 4)
    assert epx.route(logits.numpy(), **fields).capacity == 27
    assert epx.reference_route(logits.numpy(), **fields).capacity == 27
    for device in DEVICES:
        assert int(et.route(logits.to(device), **fields).capacity) == 27
    c = epx.RouteConfig(**fields)
    assert c.capacity_factor_f64 == 1.2  # the Python float, carried whole
    assert epx.route_capacity(30, c.copy(capacity_factor_f64=0.0)) == 28  # the float32 field


def _capacity_differences(Ts, Es, Ks, factors, min_capacities):
    config = epx.RouteConfig(capacity_mode=1)
    differ, checked = [], 0
    for E in Es:
        for K in (k for k in Ks if k <= E):
            for cf in factors:
                for mc in min_capacities:
                    c = config.copy(num_experts=E, top_k=K, capacity_factor=cf, min_capacity=mc)
                    for T in Ts:
                        want = _deepspeed_capacity_eager(T, E, K, cf, mc)
                        got = epx.route_capacity(T, c)
                        checked += 1
                        if got != want:
                            differ.append((T, E, K, cf, mc, got, want))
    return differ, checked


def test_capacity_sweep_matches_deepspeed():
    """The issue's sweep: every T < 400, E in {4, 8, 16, 32}, K in {3, 5, 6,
    7}, eleven common factors (57,057 configurations; 94 differ where the
    factor is taken as a float32): epx's C is DeepSpeed's everywhere."""
    differ, checked = _capacity_differences(range(1, 400), (4, 8, 16, 32), (3, 5, 6, 7),
                                            SWEEP_FACTORS, (0,))
    assert checked == 57057
    assert not differ, "%d of %d differ, e.g. (T, E, K, factor, min, epx, DeepSpeed) %s" % (
        len(differ), checked, differ[:5])


def test_capacity_sweep_powers_of_two_and_min_capacity():
    differ, checked = _capacity_differences(range(1, 400, 7), (4, 8, 16, 32), (1, 2, 4, 8, 3, 7),
                                            SWEEP_FACTORS, (0, 4, 9))
    assert checked > 10000 and not differ, differ[:5]


def test_capacity_scripted_deepspeed_agrees():
    """The scripted _capacity gives the eager one's C (so the sweep's oracle
    is DeepSpeed's under either), on the configurations where float32 and
    float64 factors disagree and a few more."""
    try:
        scripted = torch.jit.script(_deepspeed_capacity_body)
    except Exception as e:  # a torch without TorchScript
        pytest.skip("torch.jit.script: %s" % e)
    for T, E, K, cf in ((30, 4, 3, 1.2), (80, 8, 1, 1.1), (397, 32, 7, 1.1), (123, 16, 5, 1.25),
                        (250, 8, 6, 1.5), (60, 4, 3, 1.1)):
        gates = torch.zeros(T, E)
        want = int(scripted(gates, torch.tensor(cf * K), torch.tensor(0)))
        assert want == _deepspeed_capacity_eager(T, E, K, cf, 0)
        assert epx.route_capacity(T, num_experts=E, top_k=K, capacity_mode=1,
                                  capacity_factor=cf) == want


def test_capacity_in_the_moe_layer():
    """MoE(capacity_factor=1.2, top_k=3) sizes its capacity layout with
    DeepSpeed's C."""
    with epx.Comm.create_self() as comm:
        m = et.MoE(comm, 8, 4, 4, 3, max_tokens_per_rank=30, capacity_factor=1.2,
                   layout=epx.Layout.CAPACITY)
        assert m.buffer.config.capacity == 27
        del m
        gc.collect()


# ---------------------------------------------------------------------------
# epx.torch's sharp edges
# ---------------------------------------------------------------------------


def _self_buffer(comm, device="cpu", T=8, H=16, E=4, K=2):
    return et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                          device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatched_recv_source(device):
    """The source query of a Dispatched, on CUDA as on the CPU; the handle's
    id is named as such (not a token index)."""
    T, H, E, K = 8, 16, 4, 2
    assert "token" not in et.Dispatched._fields and "handle_id" in et.Dispatched._fields
    with epx.Comm.create_self() as comm:
        buf = _self_buffer(comm, device)
        x = torch.randn(T, H, device=device)
        r = et.route(torch.randn(T, E, device=device), top_k=K)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w)
        rank, token = d.recv_source()
        n = d.recv_rows_host()
        assert rank.shape == (d.recv_x.shape[0],) and rank.device == d.recv_x.device
        assert (rank[:n] == 0).all() and (rank[n:] == -1).all() and (token[n:] == -1).all()
        # each row is its source token's x, and each token reaches its K experts
        assert torch.equal(d.recv_x[:n], x[token[:n].long()])
        assert sorted(token[:n].tolist()) == sorted(list(range(T)) * K)
        if device == "cpu":
            h_rank, h_token = d.handle().recv_source()
            assert np.array_equal(h_token, token[:n].numpy())
        et.combine(d, d.recv_x).sum()
        del d
        gc.collect()
        buf.close()


def test_close_does_not_mask_an_exception_in_flight():
    """Buffer.close (and Comm.close) in a finally block or a with exit, while
    a dispatch still holds the buffer: the exception in flight propagates
    (with a note saying why the buffer stays open), not EPX_ERROR_BUSY."""
    T, E, K = 8, 4, 2
    comm = epx.Comm.create_self()
    buf = _self_buffer(comm)
    r = et.route(torch.randn(T, E), top_k=K)
    d = et.dispatch(buf, torch.randn(T, 16), r.topk_idx, r.topk_w)
    with pytest.raises(KeyError) as e:
        try:
            raise KeyError("the user's error")
        finally:
            buf.close()
    assert any("EPX_ERROR_BUSY" in n for n in getattr(e.value, "__notes__", []))
    assert not buf.closed
    with pytest.raises(ZeroDivisionError):
        with comm:
            1 / 0
    assert not buf.closed and not comm.closed
    # with nothing in flight, close still refuses by raising
    with pytest.raises(epx.BusyError, match="run the backward"):
        buf.close()
    del d
    gc.collect()
    buf.close()
    comm.close()
    assert buf.closed and comm.closed


def test_token_dispatcher_close():
    T, H, E, K = 8, 16, 4, 2
    with epx.Comm.create_self() as comm:
        with et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T) as disp:
            scores = torch.softmax(torch.randn(T, E), 1)
            top = scores.topk(K, dim=1).indices
            routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
            probs = scores * routing_map
            out, _ = disp.token_unpermutation(disp.token_permutation(torch.randn(T, H), probs,
                                                                     routing_map)[0])
            assert out.shape == (T, H)
            buf = disp.buffer
        assert disp.closed and buf.closed
        disp.close()  # twice: nothing


def test_dispatch_refuses_a_buffer_without_max_tokens():
    """comm.buffer() may leave max_tokens_per_rank to the first exchange;
    epx.torch sizes its receive tensors before it, so it refuses such a
    buffer up front, naming the fix (eager as compiled)."""
    with epx.Comm.create_self() as comm, comm.buffer(hidden=16, num_experts=4, max_top_k=2) as b:
        r = et.route(torch.randn(8, 4), top_k=2)
        with pytest.raises(epx.InvalidArgumentError, match="max_tokens_per_rank"):
            et.dispatch(b, torch.randn(8, 16), r.topk_idx, r.topk_w)


def test_torch_route_capacity_is_an_int():
    logits = torch.randn(30, 4)
    for fields in (dict(top_k=3, capacity_mode=1, capacity_factor=1.2), dict(top_k=2)):
        r = et.route(logits, **fields)
        assert type(r.capacity) is int
        assert r.capacity == epx.route(logits.numpy(), **fields).capacity


def test_renormalize_after_drop_needs_renormalize():
    """renormalize_after_drop without renormalize is refused, by name, in
    every entry point (it would otherwise do nothing)."""
    logits = torch.randn(8, 4)
    fields = dict(top_k=2, renormalize=0, renormalize_after_drop=1)
    match = "renormalize_after_drop is 1 but renormalize is 0"
    with pytest.raises(epx.InvalidArgumentError, match=match):
        epx.route(logits.numpy(), **fields)
    with pytest.raises(epx.InvalidArgumentError, match=match):
        et.route(logits, **fields)
    with epx.Comm.create_self() as comm:
        with pytest.raises(epx.InvalidArgumentError, match=match):
            et.MoE(comm, 8, 4, 4, 2, max_tokens_per_rank=8, renormalize=0,
                   renormalize_after_drop=1)
