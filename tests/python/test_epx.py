"""Tests of the Python binding (python/epx) against float64 numpy references.

Run with libepx.so from a build:
    EPX_LIBRARY=build/libepx.so PYTHONPATH=python python3 -m pytest tests/python
Inputs are fresh random numbers each run; EPX_TEST_SEED=<n> repeats a run
(every failure message names its seed). epx.torch is tested in
test_torch.py.
"""
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import epx  # noqa: E402

SEED = int(os.environ.get("EPX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
TIMEOUT = 20.0  # seconds a rank waits for its peers before EPX_ERROR_TIMEOUT


@pytest.fixture
def rng(request):
    return np.random.default_rng([SEED, sum(map(ord, request.node.name))])


def assert_close(got, ref, atol, rtol, what):
    """|got - ref| <= atol + rtol * |ref| everywhere (ref in float64)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape)
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), "%s: %d of %d outside atol %g + rtol %g (max err %g) [EPX_TEST_SEED=%d]" \
        % (what, bad.sum(), bad.size, atol, rtol, err.max(), SEED)


def payload(rng, rows, hidden, dtype=np.float32):
    """Random values in (-1, 1) (never zeros) in an aligned array."""
    a = epx.empty((rows, hidden), np.float32)
    a[:] = rng.uniform(-1, 1, (rows, hidden))
    a[a == 0] = 0.5
    return a if dtype == np.float32 else epx.to_bf16(a)


def logits_of(rng, tokens, experts):
    return rng.standard_normal((tokens, experts)).astype(np.float32)


# ---------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------


def ref_softmax(logits):
    l64 = logits.astype(np.float64)
    e = np.exp(l64 - l64.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ref_route(logits, K, renormalize):
    """Softmax top-k (ties to the lower expert): idx, w (float64), p."""
    p = ref_softmax(logits)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :K].astype(np.int32)
    w = np.take_along_axis(p, idx, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return idx, w, p


def ref_route_backward(p, idx, grad_w, renormalize, grad_aux=0.0, aux_coeff=0.0, grad_z=0.0,
                       z_coeff=0.0, logits=None):
    """d loss / d logits through softmax top-k (and the aux / z losses)."""
    T, E = p.shape
    K = idx.shape[1]
    g = grad_w.astype(np.float64)
    pc = np.take_along_axis(p, idx, axis=1)
    dp = np.zeros_like(p)
    if renormalize:
        s = pc.sum(axis=1, keepdims=True)
        dpc = g / s - (g * pc).sum(axis=1, keepdims=True) / s ** 2
    else:
        dpc = g
    np.put_along_axis(dp, idx, dpc, axis=1)
    if grad_aux:
        f = np.bincount(idx.ravel(), minlength=E) / (T * K)
        dp += grad_aux * aux_coeff * E * f[None, :] / T
    grad = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    if grad_z:
        l64 = logits.astype(np.float64)
        m = l64.max(axis=1, keepdims=True)
        lse = m + np.log(np.exp(l64 - m).sum(axis=1, keepdims=True))
        grad += grad_z * z_coeff * 2.0 * lse * p / T
    return grad


def expert_scale(e, E):
    """The test's experts: expert e multiplies its rows by 0.5 + e / E."""
    return np.where(e >= 0, 0.5 + e.astype(np.float64) / E, 0.0)


# ---------------------------------------------------------------------------
# One rank's layer step through the binding
# ---------------------------------------------------------------------------


def layer_step(comm, inputs, E, K, weighting, exchange=epx.Exchange.DEDUP, dtype=epx.DType.FLOAT32,
               renormalize=0):
    """route -> dispatch -> experts -> combine -> combine/dispatch backward ->
    route backward on this rank; returns every array the checks need."""
    x, logits, grad_out = (a[comm.rank] for a in inputs)
    T, H = x.shape
    cfg = epx.RouteConfig(num_experts=E, top_k=K, renormalize=renormalize)
    r = epx.route(logits, cfg)
    with comm.buffer(dtype=dtype, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                     exchange=exchange) as buf:
        with buf.dispatch_layout(r, weighting=weighting) as h:
            recv_x = buf.dispatch(h, x)
            recv_expert, recv_w = h.recv_routing()
            src_rank, src_token = h.recv_source()
            counts, offsets = h.expert_counts()
            scale = expert_scale(recv_expert, E)[:, None]
            f32 = epx.from_bf16(recv_x) if dtype == epx.DType.BFLOAT16 else recv_x
            expert_out = (scale * f32).astype(np.float32)
            if dtype == epx.DType.BFLOAT16:
                expert_out = epx.to_bf16(expert_out)
            out = buf.combine(h, epx.asarray(expert_out))
            if weighting == epx.Weighting.IN_COMBINE:
                grad_eo, grad_w = buf.combine_backward(h, grad_out,
                                                       expert_out=epx.asarray(expert_out))
            else:
                grad_eo, gw_none = buf.combine_backward(h, grad_out)
                assert gw_none is None
            g32 = epx.from_bf16(grad_eo) if dtype == epx.DType.BFLOAT16 else grad_eo
            grad_recv_x = (scale * g32).astype(np.float32)
            if dtype == epx.DType.BFLOAT16:
                grad_recv_x = epx.to_bf16(grad_recv_x)
            if weighting == epx.Weighting.IN_DISPATCH:
                grad_x, grad_w = buf.dispatch_backward(h, epx.asarray(grad_recv_x), x=x)
            else:
                grad_x, gw_none = buf.dispatch_backward(h, epx.asarray(grad_recv_x))
                assert gw_none is None
            stats = h.stats()
    grad_logits = epx.route_backward(logits, r, grad_w)
    return dict(route=r, recv_x=recv_x, recv_expert=recv_expert, recv_w=recv_w, src_rank=src_rank,
                src_token=src_token, counts=counts, offsets=offsets, out=out, grad_w=grad_w,
                grad_x=grad_x, grad_expert_out=grad_eo, grad_logits=grad_logits, stats=stats)


def make_inputs(rng, W, T, H, E, dtype=np.float32):
    return ([payload(rng, T, H, dtype) for _ in range(W)], [logits_of(rng, T, E) for _ in range(W)],
            [payload(rng, T, H, dtype) for _ in range(W)])


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_configs_mirror_the_c_init_macros():
    import ctypes
    rc, bc, cc = epx.RouteConfig(), epx.BufferConfig(), epx.CommConfig()
    # sizes on LP64 (the library refuses a config whose struct_size differs)
    assert (ctypes.sizeof(rc), ctypes.sizeof(bc), ctypes.sizeof(cc)) == (144, 104, 24)
    assert (rc.struct_size, rc.version) == (144, epx.CONFIG_VERSION)
    assert (rc.renormalize, rc.scaling_factor, rc.capacity_factor, rc.score_fn) == (1, 1.0, 1.0, 0)
    assert (rc.nonfinite, rc.device, rc.stream) == (epx.Nonfinite.ERROR, epx.Device.CPU, None)
    assert (bc.struct_size, bc.dtype, bc.max_tokens_rounding) == (104, epx.EPX_FLOAT32, 256)
    assert bc.low_latency == 0 and bc.placement is None  # placement: the last field, 8 more bytes
    assert (bc.expert_alignment, bc.max_tokens_per_rank) == (1, 0)
    assert (bc.combine_precision, bc.exchange_path, bc.sm_budget) == (0, 0, 0)
    assert (bc.exchange, bc.layout, bc.worst_case_sizing) == (epx.EPX_EXCHANGE_AUTO,
                                                              epx.EPX_LAYOUT_EXPERT_MAJOR, 0)
    assert (cc.timeout_seconds, cc.ranks_per_node) == (60.0, 0)
    assert epx.BufferConfig(hidden=64).copy(num_experts=8).hidden == 64
    with pytest.raises(TypeError):
        epx.RouteConfig(num_expert=8)
    assert epx.dtype_size(epx.EPX_BFLOAT16) == 2 and epx.dtype_size("float32") == 4


def test_every_public_function_of_the_header_is_bound():
    """Each function include/epx.h declares has a ctypes prototype (a
    binding that silently lacks one is how routing options went missing)."""
    import re
    from epx import _lib
    header = (pathlib.Path(__file__).resolve().parents[2] / "include" / "epx.h").read_text()
    declared = set(re.findall(r"^(?:epx_status_t|int|int32_t|size_t|const char \*)\s*"
                              r"(epx_\w+)\(", header, re.M))
    assert len(declared) > 50
    bound = set(_lib._PROTOTYPES) | set(_lib._OPTIONAL)
    assert declared - bound == set(), "unbound: %s" % sorted(declared - bound)
    for name in declared:
        assert callable(getattr(epx.lib, name))
    assert epx.library_version() == epx.VERSION


def test_config_init_functions_agree_with_the_python_defaults():
    """epx_*_config_init fills the C macros' defaults: the same bytes as the
    Python configs' defaults."""
    import ctypes
    for cls, init in ((epx.RouteConfig, epx.lib.epx_route_config_init),
                      (epx.BufferConfig, epx.lib.epx_buffer_config_init),
                      (epx.CommConfig, epx.lib.epx_comm_config_init)):
        from_c = cls()
        ctypes.memset(ctypes.byref(from_c), 0x5A, ctypes.sizeof(from_c))
        epx._check(init(ctypes.byref(from_c), ctypes.sizeof(from_c)))
        want = cls()
        assert ctypes.string_at(ctypes.byref(from_c), ctypes.sizeof(from_c)) == \
            ctypes.string_at(ctypes.byref(want), ctypes.sizeof(want)), cls.__name__


def test_aligned_arrays():
    for shape, dtype in (((0, 8), np.float32), ((3, 5), epx.DType.BFLOAT16), (7, "float16"),
                         ((2, 3, 4), np.int64)):
        a = epx.empty(shape, dtype)
        assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
        assert a.dtype == (epx.numpy_dtype(dtype) if not isinstance(dtype, type) else dtype)
    assert epx.numpy_dtype(epx.EPX_BFLOAT16) == np.uint16
    z = epx.zeros((4, 8), np.float32)
    assert not z.any() and epx.asarray(z) is z
    odd = epx.empty(33, np.float32)[1:].reshape(4, 8)
    odd[:] = 1.5
    copy = epx.asarray(odd)
    assert copy is not odd and copy.ctypes.data % 16 == 0 and np.array_equal(copy, odd)
    assert epx.asarray([[1, 2]], np.float32).dtype == np.float32


@pytest.mark.parametrize("W,weighting,renormalize", [
    (1, epx.Weighting.IN_COMBINE, 0),
    (2, epx.Weighting.IN_COMBINE, 1),
    (2, epx.Weighting.IN_DISPATCH, 0),
])
def test_layer_matches_float64_reference(rng, W, weighting, renormalize):
    T, H, E, K = 40, 32, 8, 3
    inputs = make_inputs(rng, W, T, H, E)
    res = epx.run_local(W, layer_step, inputs, E, K, weighting, renormalize=renormalize,
                        timeout_seconds=TIMEOUT)
    xs, logits, grad_outs = inputs
    for rank, got in enumerate(res):
        x64, g64 = xs[rank].astype(np.float64), grad_outs[rank].astype(np.float64)
        idx, w, p = ref_route(logits[rank], K, renormalize)
        r = got["route"]
        assert np.array_equal(r.topk_idx, idx), "topk_idx differs [EPX_TEST_SEED=%d]" % SEED
        assert_close(r.topk_w, w, 1e-6, 1e-5, "topk_w")
        assert np.array_equal(r.expert_counts, np.bincount(idx.ravel(), minlength=E))
        s = expert_scale(idx, E)
        assert_close(got["out"], (w * s).sum(1, keepdims=True) * x64, 1e-5, 1e-5, "out")
        assert_close(got["grad_x"], (w * s).sum(1, keepdims=True) * g64, 1e-5, 1e-5, "grad_x")
        grad_w = s * (g64 * x64).sum(1, keepdims=True)
        assert_close(got["grad_w"], grad_w, 1e-4, 1e-5, "grad_w")
        assert np.abs(got["grad_w"]).max() > 0  # the router learns
        assert_close(got["grad_logits"], ref_route_backward(p, idx, grad_w, renormalize),
                     1e-5, 1e-4, "grad_logits")
        # Received rows: this rank's experts, grouped by expert, copied from their source.
        e_lo, e_hi = rank * E // W, (rank + 1) * E // W
        re = got["recv_expert"]
        assert np.all((re >= e_lo) & (re < e_hi)) and np.all(np.diff(re) >= 0)
        assert np.array_equal(got["counts"], np.bincount(re - e_lo, minlength=E // W))
        assert got["offsets"][-1] == len(re)
        for src in range(W):
            rows = got["src_rank"] == src
            sent = xs[src][got["src_token"][rows]]
            if weighting == epx.Weighting.IN_DISPATCH:  # row (t, k) = w[t,k] * x[t]
                sent = got["recv_w"][rows][:, None] * sent.astype(np.float64)
            assert_close(got["recv_x"][rows], sent, 0, 1e-7, "recv_x from rank %d" % src)
        assert got["stats"].local_rows + got["stats"].send_rows >= T


def test_route_losses_and_backward(rng):
    T, E, K = 50, 16, 4
    logits = logits_of(rng, T, E)
    bias = rng.uniform(-0.1, 0.1, E).astype(np.float32)
    cfg = epx.RouteConfig(num_experts=E, top_k=K, renormalize=1, aux_loss_coeff=0.01,
                          z_loss_coeff=0.001)
    r = epx.route(logits, cfg, bias=bias)
    p = ref_softmax(logits)
    idx = np.argsort(-(p + bias), axis=1, kind="stable")[:, :K].astype(np.int32)
    assert np.array_equal(r.topk_idx, idx)
    w = np.take_along_axis(p, idx, axis=1)
    assert_close(r.topk_w, w / w.sum(1, keepdims=True), 1e-6, 1e-5, "topk_w")
    f = np.bincount(idx.ravel(), minlength=E) / (T * K)
    assert_close(r.aux_loss, 0.01 * E * (f * p.mean(0)).sum(), 1e-7, 1e-5, "aux_loss")
    l64 = logits.astype(np.float64)
    lse = l64.max(1) + np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1))
    assert_close(r.z_loss, 0.001 * (lse ** 2).mean(), 1e-7, 1e-5, "z_loss")
    assert (r.capacity, r.nonfinite_tokens) == (0, 0)
    assert r.locations.shape == (T, K) and r.locations.min() >= 0
    g = rng.uniform(-1, 1, (T, K)).astype(np.float32)
    got = epx.route_backward(logits, r, g, bias=bias, grad_aux_loss=0.7, grad_z_loss=1.3)
    ref = ref_route_backward(p, idx, g, 1, grad_aux=0.7, aux_coeff=0.01, grad_z=1.3,
                             z_coeff=0.001, logits=logits)
    assert_close(got, ref, 1e-6, 1e-4, "grad_logits")
    # keyword fields build the config; num_experts comes from the logits
    assert np.array_equal(epx.route(logits, top_k=K, renormalize=0).topk_idx,
                          np.argsort(-p, axis=1, kind="stable")[:, :K])


def test_capacity_layout_matches_dense_reference(rng):
    T, H, E, K = 64, 16, 4, 2
    x = payload(rng, T, H)
    logits = logits_of(rng, T, E)
    r = epx.route(logits, top_k=K, capacity_mode=1, capacity_factor=0.75)
    C = r.capacity
    assert C == int(np.ceil(K * T / E * 0.75)) and (r.topk_idx == -1).any()
    with epx.Comm.create_self() as comm, comm.buffer(hidden=H, num_experts=E, max_top_k=K,
                                                     layout=epx.Layout.CAPACITY, capacity=C) as buf:
        h = buf.dispatch_layout(r)
        recv_x = buf.dispatch(h, x).reshape(E, C, H)
        dense = epx.reference_dense_dispatch(x, r.topk_idx, r.topk_w, r.locations, E, C)
        assert np.array_equal(recv_x, dense)
        eo = epx.asarray(recv_x * 1.5)
        out = buf.combine(h, eo.reshape(E * C, H))
        assert_close(out, epx.reference_dense_combine(eo, r.topk_idx, r.topk_w, r.locations),
                     1e-6, 1e-6, "capacity combine")


def test_rank_major_layout_weights_in_the_expert(rng):
    W, T, H, E, K = 2, 24, 16, 8, 3
    inputs = make_inputs(rng, W, T, H, E)

    def step(comm):
        x, logits, _ = (a[comm.rank] for a in inputs)
        r = epx.route(logits, top_k=K)
        with comm.buffer(hidden=H, num_experts=E, max_top_k=K,
                         layout=epx.Layout.RANK_MAJOR) as buf:
            h = buf.dispatch_layout(r, weighting=epx.Weighting.NONE)
            recv_x = buf.dispatch(h, x)
            e, w = h.recv_routing()
            assert e.shape == (h.recv_rows, K) and w.shape == (h.recv_rows, K)
            gain = (w * expert_scale(e, E)).sum(1, keepdims=True)
            out = buf.combine(h, epx.asarray((gain * recv_x).astype(np.float32)))
            # L = sum(out): the expert's weight gradient per (row, slot),
            # brought home to the router by weights_backward
            grad_rows, _ = buf.combine_backward(h, epx.asarray(np.ones_like(out)))
            dot = (grad_rows.astype(np.float64) * recv_x).sum(1, keepdims=True)
            grad_recv_w = np.where(e >= 0, expert_scale(e, E) * dot, 0.0).astype(np.float32)
            grad_w = buf.weights_backward(h, epx.asarray(grad_recv_w))
            return r, out, grad_w

    for rank, (r, out, grad_w) in enumerate(epx.run_local(W, step, timeout_seconds=TIMEOUT)):
        x = inputs[0][rank].astype(np.float64)
        gain = (r.topk_w * expert_scale(r.topk_idx, E)).sum(1, keepdims=True)
        assert_close(out, gain * x, 1e-5, 1e-5, "rank-major out")
        want = np.where(r.topk_idx >= 0, expert_scale(r.topk_idx, E) * x.sum(1, keepdims=True), 0.0)
        assert_close(grad_w, want, 1e-5, 1e-5, "rank-major grad_w through weights_backward")
        assert np.abs(grad_w).max() > 0


@pytest.mark.parametrize("W,dtype", [(2, epx.DType.FLOAT32), (4, epx.DType.FLOAT32),
                                     (4, epx.DType.BFLOAT16)])
def test_dedup_and_collective_agree_bit_for_bit(rng, W, dtype):
    T, H, E, K = 32, 24, 16, 4
    inputs = make_inputs(rng, W, T, H, E, np.float32 if dtype == epx.DType.FLOAT32 else "bf16")

    def both(comm):
        return [layer_step(comm, inputs, E, K, epx.Weighting.IN_COMBINE, exchange=x, dtype=dtype)
                for x in (epx.Exchange.DEDUP, epx.Exchange.COLLECTIVE)]

    for rank, (dedup, coll) in enumerate(epx.run_local(W, both, timeout_seconds=TIMEOUT)):
        for name in ("recv_x", "out", "grad_w", "grad_x", "grad_expert_out", "grad_logits"):
            assert dedup[name].dtype == coll[name].dtype
            assert dedup[name].tobytes() == coll[name].tobytes(), (
                "rank %d: %s differs between dedup and collective [EPX_TEST_SEED=%d]"
                % (rank, name, SEED))
        # dedup sends a token once per destination rank, collective once per expert
        assert dedup["stats"].send_rows <= coll["stats"].send_rows
    if dtype == epx.DType.BFLOAT16:
        out = epx.from_bf16(dedup["out"])
        r = dedup["route"]
        x = epx.from_bf16(inputs[0][W - 1]).astype(np.float64)
        ref = (r.topk_w * expert_scale(r.topk_idx, E)).sum(1, keepdims=True) * x
        assert_close(out, ref, 1e-2, 2e-2, "bf16 out")


def test_a_rank_with_no_tokens(rng):
    W, T, H, E, K = 2, 20, 16, 4, 2
    x0, logits0 = payload(rng, T, H), logits_of(rng, T, E)

    def step(comm):
        x = x0 if comm.rank == 0 else epx.empty((0, H), np.float32)
        r = epx.route(logits0 if comm.rank == 0 else epx.empty((0, E), np.float32), top_k=K)
        with comm.buffer(hidden=H, num_experts=E, max_top_k=K) as buf:
            h = buf.dispatch_layout(r)
            out = buf.combine(h, buf.dispatch(h, x))
            grad_eo, grad_w = buf.combine_backward(h, out, buf.dispatch(h, x))
            grad_x, _ = buf.dispatch_backward(h, grad_eo)
            return r, out, grad_w, grad_x, buf.max_tokens

    (r, out, grad_w, grad_x, max_tokens), (r1, out1, grad_w1, grad_x1, _) = epx.run_local(
        W, step, timeout_seconds=TIMEOUT)
    assert max_tokens == 256  # T rounded up to max_tokens_rounding, agreed by the first layout
    assert r1.topk_idx.shape == (0, K) and out1.shape == grad_x1.shape == (0, H)
    assert grad_w1.shape == (0, K)
    gain = r.topk_w.sum(1, keepdims=True).astype(np.float64)
    assert_close(out, gain * x0, 1e-6, 1e-6, "out")
    assert_close(grad_x, gain * gain * x0, 1e-6, 1e-5, "grad_x")
    assert_close(grad_w, np.repeat((gain * x0 * x0).sum(1, keepdims=True), K, 1), 1e-5, 1e-5,
                 "grad_w")


def test_route_capacity_is_the_routes_capacity(rng):
    """epx.route_capacity (epx_route_capacity_of) reports the C that
    epx.route reports, in both arithmetics (the T=80, E=8, factor 1.1 edge:
    11 in float32 as DeepSpeed), and 0 in dropless mode."""
    logits = rng.standard_normal((80, 8)).astype(np.float32)
    for fields in (dict(capacity_factor=1.1),
                   dict(capacity_arithmetic=epx.CapacityArithmetic.FLOAT64, capacity_factor_f64=1.1),
                   dict(capacity_factor=0.3, min_capacity=5)):
        config = epx.RouteConfig(num_experts=8, top_k=1, capacity_mode=1, **fields)
        routed = epx.route(logits, config)
        assert epx.route_capacity(80, config) == routed.capacity
    assert epx.route_capacity(80, num_experts=8, top_k=1, capacity_mode=1, capacity_factor=1.1) == 11
    assert epx.route_capacity(80, num_experts=8, top_k=2) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        epx.route_capacity(-1, num_experts=8, top_k=2)


def test_peer_paths_of_cpu_buffers_are_the_host_path():
    """Buffer.peer_paths (epx_buffer_peer_paths): one entry per rank; a CPU
    buffer moves every peer's rows on the host path and its creation leaves
    no note (no fused path was asked of it, none refused)."""
    def step(comm):
        with comm.buffer(hidden=16, num_experts=6, max_top_k=2, exchange_path=epx.ExchangePath.FUSED) as buf:
            return buf.peer_paths(), buf.creation_note

    for paths, note in epx.run_local(3, step, timeout_seconds=TIMEOUT):
        assert paths == [epx.ExchangePath.HOST] * 3
        assert note == ""


def test_ll_mask_drops_a_masked_ranks_experts():
    """Buffer.ll_mask_rank / ll_query_mask / ll_clean_mask (epx_ll_mask_rank):
    ranks 0 and 1 mask rank 2 (which waits: a masked rank's calls are
    refused), and their step drops the routes to its experts (4 and 5):
    out = the sum over the other experts of w * (1 + e) * x, exactly; after
    the clean all three step together again."""
    W, E, H = 3, 6, 8
    cleaned = threading.Barrier(W)
    idx = np.array([[0, 4], [2, 5], [5, 4], [1, 3]], dtype=np.int32)
    w = np.array([[0.5, 0.25]] * 4, dtype=np.float32)
    x = (np.arange(4 * H, dtype=np.float32).reshape(4, H) % 7) - 3

    def step(buf, masked):
        recv, count, h = buf.ll_dispatch(x, idx, w)
        for e in range(buf.experts_per_rank):
            recv[e, :count[e]] *= 1 + buf.comm.rank * buf.experts_per_rank + e
        out = buf.ll_combine(h, recv)
        want = sum(w[:, k:k + 1] * (1 + idx[:, k:k + 1]) * x * ~np.isin(idx[:, k:k + 1] // 2, masked)
                   for k in range(2))
        return np.array_equal(out, want.astype(np.float32))

    def rank(comm):
        with comm.buffer(hidden=H, num_experts=E, max_top_k=2, max_tokens_per_rank=4,
                         low_latency=1) as buf:
            ok = [buf.ll_query_mask() == [0] * W]
            if comm.rank != 2:
                buf.ll_mask_rank(2)
                ok += [buf.ll_query_mask() == [0, 0, 1], step(buf, [2])]
                buf.ll_clean_mask()
                ok.append(buf.ll_query_mask() == [0] * W)
            cleaned.wait()
            ok.append(step(buf, []))
            return ok

    for ok in epx.run_local(W, rank, timeout_seconds=TIMEOUT):
        assert all(ok), ok


def test_bf16_round_trip(rng):
    bits = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)
    bits = bits[((bits >> 7) & 0xFF) != 0xFF]  # no Inf/NaN
    f = epx.from_bf16(bits)
    assert f.dtype == np.float32
    assert np.array_equal(f.view(np.uint32), bits.astype(np.uint32) << 16)
    assert np.array_equal(epx.to_bf16(f), bits)
    # float32 -> bf16 rounds to nearest even, as numpy does it here with integers
    x = rng.standard_normal(4096).astype(np.float32) * np.float32(100.0)
    u = x.view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    got = epx.to_bf16(x)
    assert got.dtype == np.uint16 and np.array_equal(got, rne)
    assert_close(epx.from_bf16(got), x, 0, 2.0 ** -8, "bf16 round trip")
    # every conversion of epx_convert, shapes kept, outputs aligned
    h = epx.convert(x.reshape(64, 64), epx.DType.FLOAT16)
    assert h.dtype == np.float16 and h.shape == (64, 64) and h.ctypes.data % 16 == 0
    assert np.array_equal(h, x.reshape(64, 64).astype(np.float16))


def test_errors_raise_with_the_library_message(rng):
    logits = logits_of(rng, 8, 4)
    with pytest.raises(epx.EpxError) as e:
        epx.route(logits, top_k=5)
    assert e.value.status == epx.Status.ERROR_INVALID_ARGUMENT
    assert e.value.status_name == "EPX_ERROR_INVALID_ARGUMENT"
    assert "epx_route: top_k" in e.value.message and e.value.message in str(e.value)

    T, H, E, K = 16, 16, 4, 2
    x = payload(rng, T, H)
    r = epx.route(logits_of(rng, T, E), top_k=K)
    with epx.Comm.create_self() as comm:
        with pytest.raises(epx.EpxError) as e:
            comm.buffer(hidden=12, num_experts=E, max_top_k=K)
        assert "hidden" in e.value.message
        buf = comm.buffer(hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T)
        bad = r.topk_idx.copy()
        bad[3, 1] = E
        with pytest.raises(epx.EpxError) as e:
            buf.dispatch_layout(bad, r.topk_w)
        assert e.value.status == epx.Status.ERROR_INVALID_ARGUMENT
        assert "routing.topk_idx[3][1]" in e.value.message
        big = np.zeros((T + 1, K), np.int32)
        with pytest.raises(epx.EpxError) as e:
            buf.dispatch_layout(big, np.ones((T + 1, K), np.float32))
        assert e.value.status == epx.Status.ERROR_CAPACITY_EXCEEDED
        assert "max_tokens_per_rank" in e.value.message

        h = buf.dispatch_layout(r)
        n = h.recv_rows
        # the library refuses a receive buffer too small; the output is untouched
        small = epx.empty((n - 1, H), np.float32)
        small[:] = np.float32(-7.25)
        with pytest.raises(epx.EpxError) as e:
            buf.dispatch(h, x, out=small)
        assert e.value.status == epx.Status.ERROR_CAPACITY_EXCEEDED
        assert "recv_rows_capacity" in e.value.message and np.all(small == -7.25)
        # checks made in Python name the argument and the fix
        with pytest.raises(epx.EpxError, match="x has dtype float64"):
            buf.dispatch(h, x.astype(np.float64))
        with pytest.raises(epx.EpxError, match="x has shape"):
            buf.dispatch(h, x[:-1])
        with pytest.raises(epx.EpxError, match="not C-contiguous"):
            buf.dispatch(h, np.asfortranarray(x))
        misaligned = epx.empty(T * H + 1, np.float32)[1:].reshape(T, H)
        misaligned[:] = x
        with pytest.raises(epx.EpxError, match="not 16-byte aligned") as e:
            buf.dispatch(h, misaligned)
        assert e.value.status == epx.Status.ERROR_INVALID_ARGUMENT
        expert_out = buf.dispatch(h, x)
        with pytest.raises(epx.EpxError, match="grad_w is what the router learns from"):
            buf.combine_backward(h, x)
        grad_eo, no_w = buf.combine_backward(h, x, grad_w=False)
        assert no_w is None and grad_eo.shape == (n, H)
        with pytest.raises(epx.EpxError, match="not applied in dispatch"):
            buf.dispatch_backward(h, expert_out, x=x)
        with epx.Comm.create_self() as comm2, comm2.buffer(hidden=H, num_experts=E,
                                                           max_top_k=K) as other:
            with pytest.raises(epx.EpxError, match="another buffer") as e:
                other.dispatch(h, x)
            assert e.value.status == epx.Status.ERROR_INVALID_HANDLE
        buf.close()


def test_refusal_in_python_fails_the_peers_at_once(rng):
    """A check made in Python on one rank still reaches the collective, so its
    peers fail with EPX_ERROR_PEER_FAILED instead of timing out."""
    W, T, H, E, K = 2, 16, 16, 4, 2
    inputs = make_inputs(rng, W, T, H, E)

    def step(comm):
        x, logits, _ = (a[comm.rank] for a in inputs)
        r = epx.route(logits, top_k=K)
        seen = []
        with comm.buffer(hidden=H, num_experts=E, max_top_k=K) as buf:
            idx = r.topk_idx.astype(np.int64) if comm.rank == 1 else r.topk_idx
            with pytest.raises(epx.EpxError) as e:
                buf.dispatch_layout(idx, r.topk_w)
            seen.append((e.value.status, e.value.in_library))
            h = buf.dispatch_layout(r)
            bad_x = x.astype(np.float64) if comm.rank == 0 else x
            with pytest.raises(epx.EpxError) as e:
                buf.dispatch(h, bad_x)
            seen.append((e.value.status, e.value.in_library))
            # the comm is still good: both ranks go on together
            assert_close(buf.combine(h, buf.dispatch(h, x)), x, 1e-6, 1e-6, "combine(dispatch(x))")
        return seen

    import time
    start = time.monotonic()
    seen = epx.run_local(W, step, timeout_seconds=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2
    invalid, peer = epx.Status.ERROR_INVALID_ARGUMENT, epx.Status.ERROR_PEER_FAILED
    assert seen[0] == [(peer, True), (invalid, False)]
    assert seen[1] == [(invalid, False), (peer, True)]


def test_handle_lifetime(rng):
    T, H, E, K = 16, 16, 4, 2
    x = payload(rng, T, H)
    r = epx.route(logits_of(rng, T, E), top_k=K)
    comm = epx.Comm.create_self()
    buf = comm.buffer(hidden=H, num_experts=E, max_top_k=K)
    h = buf.dispatch_layout(r)
    h2 = h.retain()
    h.release()
    h.release()  # a second release does nothing
    assert h.released and not h2.released
    for use in (lambda: buf.dispatch(h, x), lambda: h.recv_rows, lambda: h.expert_counts(),
                lambda: h.stats(), lambda: buf.combine(h, x)):
        with pytest.raises(epx.EpxError, match="released") as e:
            use()
        assert e.value.status == epx.Status.ERROR_INVALID_HANDLE
    recv_x = buf.dispatch(h2, x)  # the retained reference still drives the layout
    with buf.dispatch_layout(r) as h3:
        assert np.array_equal(buf.dispatch(h3, x), recv_x)
    assert h3.released
    # the comm cannot go while it has a buffer; closing the comm closes the
    # buffer, which releases its handles first
    h4 = buf.dispatch_layout(r)
    comm.close()
    assert comm.closed and buf.closed and h2.released and h4.released
    with pytest.raises(epx.EpxError) as e:
        buf.dispatch(h4, x)
    assert e.value.status == epx.Status.ERROR_INVALID_HANDLE
    with pytest.raises(epx.EpxError, match="closed"):
        comm.buffer(hidden=H, num_experts=E, max_top_k=K)
    # objects left to the garbage collector are released children first
    for _ in range(3):
        c = epx.Comm.create_self()
        b = c.buffer(hidden=H, num_experts=E, max_top_k=K)
        hs = [b.dispatch_layout(r) for _ in range(2)]
        del c, b, hs
    gc.collect()


def test_recorder_replays_without_a_new_layout(rng):
    T, H, E, K = 16, 16, 4, 2
    x = payload(rng, T, H)
    r = epx.route(logits_of(rng, T, E), top_k=K)
    with epx.Comm.create_self() as comm:
        buf = comm.buffer(hidden=H, num_experts=E, max_top_k=K)
        rec = epx.Recorder(validate=True)
        with buf.dispatch_layout(r, recorder=rec) as h:
            out = buf.dispatch(h, x)
        rec.replay()
        with buf.dispatch_layout(r, recorder=rec) as h:
            assert np.array_equal(buf.dispatch(h, x), out)
        s = rec.stats()
        assert (s.records, s.replays, s.fallbacks) == (1, 1, 0) and s.bytes_held > 0
        rec.replay()
        other = r.topk_idx.copy()
        other[0] = other[0][::-1]
        with pytest.raises(epx.EpxError) as e:
            buf.dispatch_layout(other, r.topk_w, recorder=rec)
        assert e.value.status == epx.Status.ERROR_REPLAY_MISMATCH and "call 0" in e.value.message
        # the recorder keeps its handles alive: the buffer is busy until it closes
        with pytest.raises(epx.EpxError) as e:
            buf.close()
        assert e.value.status == epx.Status.ERROR_BUSY and not buf.closed
        rec.close()
        buf.close()


def test_run_local_raises_the_failing_ranks_error():
    def fn(comm):
        if comm.rank == 1:
            raise ValueError("rank one failed")
        return comm.rank

    with pytest.raises(ValueError, match="rank one failed"):
        epx.run_local(2, fn, timeout_seconds=TIMEOUT)
    assert epx.run_local(3, lambda comm: (comm.rank, comm.size), timeout_seconds=TIMEOUT) == [
        (0, 3), (1, 3), (2, 3)]


MPI_SHAPE = dict(W=2, T=24, H=16, E=8, K=2)


def mpi_inputs(seed):
    return make_inputs(np.random.default_rng(seed), *(MPI_SHAPE[k] for k in "WTHE"))


def mpi_worker(out_dir, seed):
    """One rank of test_mpi_transport_agrees_with_local, under mpiexec."""
    from mpi4py import MPI
    inputs = mpi_inputs(seed)
    with epx.Comm.from_mpi(MPI.COMM_WORLD, timeout_seconds=TIMEOUT) as comm:
        assert (comm.rank, comm.size) == (MPI.COMM_WORLD.rank, MPI_SHAPE["W"])
        got = layer_step(comm, inputs, MPI_SHAPE["E"], MPI_SHAPE["K"], epx.Weighting.IN_COMBINE)
    np.savez(os.path.join(out_dir, "rank%d.npz" % comm.rank),
             **{k: got[k] for k in ("recv_x", "out", "grad_w", "grad_x", "grad_logits")})


def test_mpi_transport_agrees_with_local(tmp_path):
    """Comm.from_mpi over mpi4py's COMM_WORLD (2 processes) gives what the
    local transport gives, bit for bit."""
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec")
    if not (mpiexec and epx.has_mpi()):
        pytest.skip("needs mpiexec and a libepx built with MPI")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", EPX_LIBRARY=epx.library_path)
    command = [mpiexec, "-n", str(MPI_SHAPE["W"]), sys.executable, __file__, "mpi-worker",
               str(tmp_path), str(SEED)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, "mpiexec failed:\n%s\n%s" % (run.stdout, run.stderr)
    local = epx.run_local(MPI_SHAPE["W"], layer_step, mpi_inputs(SEED), MPI_SHAPE["E"],
                          MPI_SHAPE["K"], epx.Weighting.IN_COMBINE, timeout_seconds=TIMEOUT)
    for rank, want in enumerate(local):
        with np.load(tmp_path / ("rank%d.npz" % rank)) as got:
            for name in got.files:
                assert got[name].tobytes() == want[name].tobytes(), (
                    "rank %d: %s differs between MPI and local [EPX_TEST_SEED=%d]"
                    % (rank, name, SEED))


# ---------------------------------------------------------------------------
# Routing options (issue 9) and the routing collectives, from Python
# ---------------------------------------------------------------------------

ROUTING_CASES = [
    dict(),
    dict(score_fn=epx.ScoreFn.SIGMOID, num_groups=4, topk_groups=2, scaling_factor=2.5),
    dict(score_fn=epx.ScoreFn.SOFTMAX_AFTER_TOPK, renormalize=0, num_groups=4, topk_groups=2,
         group_score_experts=1),
    dict(score_fn=epx.ScoreFn.SQRT_SOFTPLUS, aux_counts=epx.AuxCounts.PLAIN_TOPK),
    dict(capacity_mode=1, capacity_factor=1.1, queue_order=epx.QueueOrder.BY_TOKEN,
         drop_policy=epx.DropPolicy.BY_PROBABILITY, renormalize_after_drop=1),
    dict(capacity_mode=1, capacity_arithmetic=epx.CapacityArithmetic.FLOAT64,
         capacity_factor_f64=0.6, drop_policy=epx.DropPolicy.BY_SCORE, min_capacity=2),
    dict(capacity_mode=1, capacity_factor=0.7, drop_policy=epx.DropPolicy.BY_RANDOM_PRIORITY,
         random_seed=12345, aux_counts=epx.AuxCounts.FIRST_CHOICE),
    dict(aux_loss_sequences=4, z_loss_coeff=0.01),
]


@pytest.mark.parametrize("case", range(len(ROUTING_CASES)))
def test_every_routing_option_matches_the_reference(rng, case):
    """epx.route with each routing option (and a padding mask) against
    epx.reference_route, the float64 spec: integers exactly, weights and
    losses to 1e-5; route_backward against reference_route_backward."""
    T, E, K = 48, 16, 3
    logits = logits_of(rng, T, E)
    bias = rng.uniform(-0.05, 0.05, E).astype(np.float32)
    mask = rng.uniform(size=T) > 0.2
    fields = dict(ROUTING_CASES[case], top_k=K, aux_loss_coeff=0.01)
    r = epx.route(logits, bias=bias, token_mask=mask, **fields)
    ref = epx.reference_route(logits, bias=bias, token_mask=mask, **fields)
    for name in ("topk_idx", "locations", "expert_counts"):
        assert np.array_equal(getattr(r, name), getattr(ref, name)), \
            "%s differs (case %d) [EPX_TEST_SEED=%d]" % (name, case, SEED)
    assert r.capacity == ref.capacity and ref.topk_w.dtype == np.float64
    assert np.all(r.topk_idx[~mask] == -1) and np.all(r.topk_w[~mask] == 0)
    assert_close(r.topk_w, ref.topk_w, 1e-6, 1e-5, "topk_w")
    assert_close(r.aux_loss, ref.aux_loss, 1e-7, 1e-5, "aux_loss")
    assert_close(r.z_loss, ref.z_loss, 1e-7, 1e-5, "z_loss")
    g = rng.uniform(-1, 1, (T, K)).astype(np.float32)
    got = epx.route_backward(logits, r, g, bias=bias, grad_aux_loss=0.7, grad_z_loss=1.3)
    want = epx.reference_route_backward(logits, r, g, bias=bias, grad_aux_loss=0.7,
                                        grad_z_loss=1.3)
    assert want.dtype == np.float64 and np.abs(want).max() > 0
    assert_close(got, want, 1e-6, 1e-4, "grad_logits")


def test_capacity_arithmetic_edge_cases():
    """T=80, E=8, K=1, factor 1.1: C = 11 in DeepSpeed's float32 and in
    Megatron's float64 (issue 9's off-by-one)."""
    logits = np.zeros((80, 8), np.float32)
    logits[np.arange(80), np.arange(80) % 8] = 1.0
    r32 = epx.route(logits, top_k=1, capacity_mode=1, capacity_factor=1.1)
    r64 = epx.route(logits, top_k=1, capacity_mode=1, capacity_factor_f64=1.1,
                    capacity_arithmetic=epx.EPX_CAPACITY_FLOAT64)
    assert (r32.capacity, r64.capacity) == (11, 11)


def counts_rank(comm, E):
    """Different per-expert counts on each rank, then both routing
    collectives, and the global aux loss from the summed counts."""
    rng = np.random.default_rng([SEED, comm.rank])
    logits = logits_of(rng, 20 + 4 * comm.rank, E)
    r = epx.route(logits, top_k=2)
    cap = epx.route_agree_capacity(comm, r.expert_counts)
    total = comm.route_sum_counts(r.expert_counts)
    tokens = comm.allgather(np.array([logits.shape[0]], np.int64)).sum()
    g = epx.route(logits, top_k=2, aux_loss_coeff=0.1, aux_loss_expert_counts=total,
                  aux_loss_tokens=float(tokens))
    ref = epx.reference_route(logits, top_k=2, aux_loss_coeff=0.1, aux_loss_expert_counts=total,
                              aux_loss_tokens=float(tokens))
    comm.barrier()
    return dict(counts=r.expert_counts, cap=cap, total=total, tokens=tokens, aux=g.aux_loss,
                ref_aux=ref.aux_loss, cap_self=comm.route_agree_capacity(r.expert_counts))


def test_route_agree_capacity_sum_counts_and_the_global_aux_loss():
    E, W = 8, 3
    res = epx.run_local(W, counts_rank, E, timeout_seconds=TIMEOUT)
    counts = np.stack([r["counts"] for r in res])
    for r in res:
        assert r["cap"] == r["cap_self"] == counts.max()
        assert r["total"].dtype == np.float32 and np.array_equal(r["total"], counts.sum(0))
        assert r["tokens"] == 20 + 24 + 28
        assert_close(r["aux"], r["ref_aux"], 1e-7, 1e-5, "global aux loss")
    gathered = epx.run_local(2, lambda c: c.allgather(np.full((2, 3), c.rank, np.int16)))
    assert gathered[0].shape == (2, 2, 3) and np.array_equal(gathered[0][1], np.ones((2, 3)))


def test_a_refused_routing_collective_fails_the_peers():
    """Counts of the wrong kind on one rank: that rank gets the library's
    InvalidArgumentError, its peer PeerFailedError at once (not a timeout)."""
    def rank_main(comm):
        try:
            epx.route_agree_capacity(comm, [] if comm.rank == 0 else [1, 2])
        except epx.EpxError as e:
            return type(e)
    got = epx.run_local(2, rank_main, timeout_seconds=TIMEOUT)
    assert got == [epx.InvalidArgumentError, epx.PeerFailedError]


if __name__ == "__main__" and sys.argv[1:2] == ["mpi-worker"]:
    mpi_worker(sys.argv[2], int(sys.argv[3]))
