"""Bad input through the Python layer, as a careless PyTorch user would pass
it (issue 29): every tensor checked against the handle before any C call
(fewer rows than the dispatch received was an out-of-bounds read in
combine), expert ids checked in the caller's dtype before the int32 cast,
Python ints range-checked for their C type, epx's own message for a bad
route config, the route-config cache bounded. CI also runs this file under
an AddressSanitizer build of the library.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python
"""
import ctypes
import gc
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402

T, H, E, K = 8, 16, 4, 2


def _layer(comm, **fields):
    buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                         **fields)
    x = torch.randn(T, H, requires_grad=True)
    r = et.route(torch.randn(T, E, requires_grad=True), top_k=K)
    return buf, x, r


# ---------------------------------------------------------------------------
# 1. Every tensor against the handle before any C call
# ---------------------------------------------------------------------------


def test_combine_refuses_fewer_rows_than_received():
    with epx.Comm.create_self() as comm:
        buf, x, r = _layer(comm)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w)
        n = d.recv_rows_host()
        for rows in (0, 1, n - 1):
            with pytest.raises(epx.InvalidArgumentError, match="expert_out has %d rows; the "
                               "dispatch received %d" % (rows, n)):
                et.combine(d, d.recv_x[:rows])
        with pytest.raises(epx.InvalidArgumentError, match="any dispatch on this buffer at most"):
            et.combine(d, torch.cat([d.recv_x, d.recv_x]))
        with pytest.raises(epx.InvalidArgumentError, match="expert_out has dtype"):
            et.combine(d, d.recv_x.double())
        with pytest.raises(epx.InvalidArgumentError, match="expert_out has shape"):
            et.combine(d, d.recv_x[:, :H - 1])
        with pytest.raises(epx.InvalidArgumentError, match="expert_out has shape"):
            et.combine(d, d.recv_x.reshape(-1))
        with pytest.raises(epx.InvalidArgumentError, match="the dispatch had 8 tokens"):
            et.combine(d._replace(num_tokens=T + 5), d.recv_x)
        # the valid rows alone (N of them, the host knows N on the CPU) and a
        # strided view are fine
        out = et.combine(d, d.recv_x[:n])
        assert torch.equal(out, et.combine(d, d.recv_x.t().contiguous().t()))
        out.sum().backward()
        del d, out
        gc.collect()
        buf.close()


def test_token_unpermutation_refuses_fewer_rows():
    with epx.Comm.create_self() as comm:
        disp = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T)
        scores = torch.softmax(torch.randn(T, E), 1)
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(K, 1).indices,
                                                                   True)
        rows, _ = disp.token_permutation(torch.randn(T, H), scores * routing_map, routing_map)
        with pytest.raises(epx.InvalidArgumentError, match="expert_out has 3 rows; the dispatch"):
            disp.token_unpermutation(rows[:3])
        with pytest.raises(epx.InvalidArgumentError, match="probs has shape"):
            disp.token_permutation(torch.randn(T, H), scores[:, :2], routing_map)
        with pytest.raises(epx.InvalidArgumentError, match="hidden_states has shape"):
            disp.token_permutation(torch.randn(T, H + 1), scores * routing_map, routing_map)
        disp.token_unpermutation(rows)
        disp.close()


def test_backward_ops_refuse_tensors_that_do_not_fit_the_handle():
    """The backward custom ops are entry points too (torch.ops.epx.*)."""
    with epx.Comm.create_self() as comm:
        buf, x, r = _layer(comm)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w)
        n = d.recv_rows_host()
        ops = torch.ops.epx
        with pytest.raises(epx.InvalidArgumentError, match="grad_recv_x has 2 rows; the dispatch"):
            ops.dispatch_backward(d.recv_x[:2].contiguous(), None, d.handle_id, T, K)
        with pytest.raises(epx.InvalidArgumentError, match="the dispatch had 8 tokens"):
            ops.dispatch_backward(d.recv_x, None, d.handle_id, T - 1, K)
        with pytest.raises(epx.InvalidArgumentError, match="grad_recv_w has 1 rows; the dispatch"):
            ops.weights_backward(torch.zeros(1), d.handle_id, T, K)
        with pytest.raises(epx.InvalidArgumentError, match="grad_recv_w has shape"):
            ops.weights_backward(torch.zeros(n, K), d.handle_id, T, K)
        with pytest.raises(epx.InvalidArgumentError,
                           match="grad_expert_out has 1 rows; the dispatch received"):
            ops.combine_backward(torch.zeros(T, H), None, d.handle_id, 1, K)
        with pytest.raises(epx.InvalidArgumentError, match="grad_expert_out has 4294967296 rows"):
            ops.combine_backward(torch.zeros(T, H), None, d.handle_id, 2 ** 32, K)
        with pytest.raises(epx.InvalidArgumentError, match="the dispatch had 8 tokens"):
            ops.combine_backward(torch.zeros(T - 3, H), None, d.handle_id, n, K)
        with pytest.raises(epx.InvalidArgumentError, match="recv_x has 1099511627776 rows"):
            ops.dispatch_cached(x.detach(), d.handle_id, 2 ** 40, K)
        with pytest.raises(epx.InvalidArgumentError, match="top_k 2, not 8 and 3"):
            ops.dispatch_cached(x.detach(), d.handle_id, n, 3)
        et.combine(d, d.recv_x).sum().backward()
        del d
        gc.collect()
        buf.close()


def test_a_short_expert_out_on_two_ranks_fails_both_at_once():
    """Rank 0's refusal reaches rank 1 as EPX_ERROR_PEER_FAILED at once (no
    garbage from rank 0 reaches rank 1's tokens, and nobody waits for the
    timeout)."""
    def rank_main(comm):
        buf, x, r = _layer(comm)
        d = et.dispatch(buf, x, r.topk_idx, r.topk_w)
        short = d.recv_x[:1] if comm.rank == 0 else d.recv_x
        try:
            et.combine(d, short)
        finally:
            del d
            gc.collect()
    with pytest.raises(epx.InvalidArgumentError, match="expert_out has 1 rows; the dispatch"):
        epx.run_local(2, rank_main, timeout_seconds=30)


# ---------------------------------------------------------------------------
# 2. Expert ids in the caller's dtype
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad,match", [
    (2 ** 32 + 1, r"topk_idx\[3, 1\] is 4294967297, outside \[-1, 3\]"),
    (-2 ** 32 + 1, r"topk_idx\[3, 1\] is -4294967295"),
    (4, r"topk_idx\[3, 1\] is 4, outside \[-1, 3\]"),
    (-2, r"topk_idx\[3, 1\] is -2"),
])
def test_dispatch_refuses_ids_out_of_range_before_the_cast(bad, match):
    with epx.Comm.create_self() as comm:
        buf, x, r = _layer(comm)
        idx = r.topk_idx.long().clone()
        idx[3, 1] = bad
        with pytest.raises(epx.InvalidArgumentError, match=match):
            et.dispatch(buf, x, idx, r.topk_w)
        buf.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_dispatch_refuses_non_integer_ids(dtype):
    with epx.Comm.create_self() as comm:
        buf, x, r = _layer(comm)
        with pytest.raises(epx.InvalidArgumentError, match="topk_idx has dtype"):
            et.dispatch(buf, x, r.topk_idx.to(dtype) + 0.9 if dtype.is_floating_point
                        else r.topk_idx.to(dtype), r.topk_w)
        with pytest.raises(epx.InvalidArgumentError, match="locations has dtype"):
            et.dispatch(buf, x, r.topk_idx, r.topk_w, locations=r.locations.to(dtype))
        buf.close()


def test_dispatch_takes_ids_of_any_integer_dtype():
    with epx.Comm.create_self() as comm:
        buf, x, r = _layer(comm)
        outs = []
        for dtype in (torch.int32, torch.int64, torch.int16, torch.uint8):
            d = et.dispatch(buf, x, r.topk_idx.to(dtype), r.topk_w)
            outs.append(et.combine(d, d.recv_x).detach())
            del d
            gc.collect()
        assert all(torch.equal(o, outs[0]) for o in outs)
        buf.close()


# ---------------------------------------------------------------------------
# 3. Python ints crossing into C, range-checked for their C type
# ---------------------------------------------------------------------------


def test_config_fields_refuse_ints_outside_their_c_type():
    with epx.Comm.create_self() as comm:
        for field, value, ctype in (("num_experts", 2 ** 32 + 4, "int32_t"),
                                    ("hidden", 2 ** 64 + 16, "int64_t"),
                                    ("max_top_k", 2 ** 32 + 2, "int32_t"),
                                    ("max_tokens_per_rank", -2 ** 63 - 1, "int64_t")):
            fields = dict(hidden=16, num_experts=4, max_top_k=2, max_tokens_per_rank=8)
            fields[field] = value
            with pytest.raises(epx.InvalidArgumentError,
                               match=r"BufferConfig\.%s is %d, outside the range of its C type %s"
                               % (field, value, ctype)):
                et.make_buffer(comm, **fields)
    logits = torch.randn(8, 4)
    with pytest.raises(epx.InvalidArgumentError, match=r"RouteConfig\.top_k is 4294967298"):
        et.route(logits, top_k=2 ** 32 + 2)
    with pytest.raises(epx.InvalidArgumentError, match=r"RouteConfig\.top_k is 4294967298"):
        epx.route(logits.numpy(), top_k=2 ** 32 + 2)
    with pytest.raises(epx.InvalidArgumentError, match=r"RouteConfig\.random_seed is -1"):
        epx.RouteConfig(random_seed=-1)
    with pytest.raises(epx.InvalidArgumentError, match=r"CommConfig|RouteConfig\.min_capacity"):
        epx.RouteConfig(min_capacity=2 ** 31)
    # in range: unchanged
    c = epx.RouteConfig(num_experts=2 ** 31 - 1, random_seed=2 ** 64 - 1)
    assert (c.num_experts, c.random_seed) == (2 ** 31 - 1, 2 ** 64 - 1)


def test_function_arguments_refuse_ints_outside_their_c_type():
    with pytest.raises(epx.InvalidArgumentError, match="LocalWorld: size is 4294967297"):
        epx.LocalWorld(2 ** 32 + 1)
    with pytest.raises(epx.InvalidArgumentError, match="num_tokens is 9223372036854775808"):
        epx.route_capacity(2 ** 63, num_experts=4, top_k=2, capacity_mode=1)
    with epx.LocalWorld(2) as world:
        with pytest.raises(epx.InvalidArgumentError, match="LocalWorld.comm: rank is 4294967296"):
            world.comm(2 ** 32)
    # the net under every bound C function: a position, where no name is known
    cap = ctypes.c_int32()
    with pytest.raises(epx.InvalidArgumentError, match="epx_route_capacity_of: argument 2 is"):
        epx.lib.epx_route_capacity_of(ctypes.byref(epx.RouteConfig(num_experts=4, top_k=2)),
                                      2 ** 64, ctypes.byref(cap))
    with pytest.raises(epx.InvalidArgumentError, match="num_experts is 4294967300"):
        epx.reference_dense_dispatch(np.zeros((2, 16), np.float32), np.zeros((2, 1), np.int32),
                                     np.ones((2, 1), np.float32), np.zeros((2, 1), np.int32),
                                     2 ** 32 + 4, 2)


# ---------------------------------------------------------------------------
# 4. epx's message for a bad route config, not torch's
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fields,match", [
    (dict(top_k=-1), "top_k is -1; pass 1 <= top_k <= num_experts"),
    (dict(top_k=2, num_experts=-3), "num_experts is -3; pass at least 1 expert"),
    (dict(top_k=0), "top_k is 0"),
    (dict(top_k=5), "top_k 5 exceeds num_experts 4"),
])
def test_torch_route_refuses_a_bad_config_in_epx_words(fields, match):
    with pytest.raises(epx.InvalidArgumentError, match=match):
        et.route(torch.randn(8, 4), **fields)


def test_numpy_route_refuses_a_bad_config_before_sizing_outputs():
    """top_k = 2**31 - 1 is refused by epx, not by a [T, 2**31 - 1]
    allocation first."""
    for fn in (epx.route, epx.reference_route):
        with pytest.raises(epx.InvalidArgumentError, match="top_k 2147483647 exceeds"):
            fn(np.zeros((8, 4), np.float32), top_k=2 ** 31 - 1)


def test_torch_route_refuses_non_tensor_logits():
    with pytest.raises(epx.InvalidArgumentError, match="logits is a list"):
        et.route([[1.0, 2.0]], top_k=1)


# ---------------------------------------------------------------------------
# 5. The route-config cache is bounded
# ---------------------------------------------------------------------------


def test_route_config_cache_is_bounded():
    """A value that changes every step (an annealed aux_loss_coeff) makes a
    new config each call: the cache stays bounded, and a config evicted
    from it still works (its backward, long after)."""
    logits = torch.randn(8, 4, requires_grad=True)
    first = et.route(logits, top_k=2, aux_loss_coeff=0.5)
    for step in range(3 * et._CONFIGS_KEPT):
        et.route(logits, top_k=2, aux_loss_coeff=1e-3 * (step + 1), aux_loss_tokens=step + 1.0)
    assert len(et._CONFIGS) <= et._CONFIGS_KEPT
    (first.topk_w.sum() + first.aux_loss).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with torch.no_grad():
        again = et.route(logits, top_k=2, aux_loss_coeff=0.5)
    assert torch.equal(again.topk_w, first.topk_w.detach())
