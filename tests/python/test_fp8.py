"""FP8 payloads: epx's quantizers bit for bit against the peers' formulas
written in PyTorch (DeepEP's per_token_cast_to_fp8 and per_token_cast_back,
DeepGEMM's ceil_to_ue8m0 with DeepEP's packed UE8M0 words,
TransformerEngine's MXFP8 float_to_e8m0 / exp2f_rcp with its saturating e4m3
cast) on shared vectors with NaN, infinities, huge and tiny values, zero
blocks and e4m3 subnormals; and epx.torch.dispatch with float8_e4m3fn rows
and scales (pre-quantized and quantized on the way) against a pure-PyTorch
reference that gathers each received row from its source."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
import epx.torch as et  # noqa: E402

F = epx.FP8Format
FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


# ---------------------------------------------------------------------------
# The peers' formulas in PyTorch (eager)
# ---------------------------------------------------------------------------

# amax / 448.0 as PyTorch computes it on CUDA, where a division by a CPU
# scalar is a multiply by its float32 reciprocal (on the CPU it divides, and
# differs in the last bit), and a NaN comes out as the GPU's 0x7fffffff (the
# CPU keeps the operand's): the scales epx matches, the GPU's peers' ones.
INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)


def cuda_amax_448(amax):
    s = amax * INV_448
    bits = torch.where(torch.isnan(s), torch.full_like(s.view(torch.int32), 0x7FFFFFFF), s.view(torch.int32))
    return bits.view(torch.float32)


def deepep_cast(x):
    """DeepEP tests/utils.py per_token_cast_to_fp8 (H a multiple of 128)."""
    m, n = x.shape
    v = x.view(m, -1, 128)
    amax = v.abs().float().amax(dim=2).view(m, -1).clamp(1e-4)
    return (v * (448.0 / amax.unsqueeze(2))).to(FP8).view(m, n), cuda_amax_448(amax).view(m, -1)


def deepgemm_ue8m0_cast(x):
    """DeepGEMM per_token_cast_to_fp8(use_ue8m0=True), the scales as DeepEP
    packs them: exponent bytes, four to an int32 word."""
    m, n = x.shape
    v = x.view(m, -1, 128)
    amax = v.abs().float().amax(dim=2).view(m, -1).clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2(cuda_amax_448(amax).abs())))
    q = (v * (1.0 / sf.unsqueeze(2))).to(FP8).view(m, n)
    byte = (sf.view(torch.int32) >> 23).to(torch.uint8)
    return q, byte.contiguous().view(torch.int32)


def te_mxfp8_cast(x):
    """TransformerEngine's MXFP8 rowwise quantizer (amax skips NaN as fmaxf
    does; float_to_e8m0; exp2f_rcp; the satfinite e4m3 cast)."""
    m, n = x.shape
    v = x.float().view(m, -1, 32)
    a = v.abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=2)
    val = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    bits = val.view(torch.int32)
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    e = exp + up.to(exp.dtype)
    e = torch.where(torch.isinf(val), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(val), torch.full_like(e, 0xFF), e)
    e = torch.where(val == 0, torch.zeros_like(e), e)
    rcp = torch.where(e == 255, torch.full_like(e, 0x7FFFFFFF),
                      torch.where(e == 254, torch.full_like(e, 0x00400000), (254 - e) << 23))
    q = (v * rcp.view(torch.float32).unsqueeze(2)).clamp(-448.0, 448.0).to(FP8).view(m, n)
    return q, e.to(torch.uint8)


def deepep_cast_back(q, scales, dtype):
    """DeepEP per_token_cast_back (both scale kinds), rounded to dtype."""
    m, n = q.shape
    if scales.dtype == torch.int32:
        scales = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (q.float().view(m, -1, 128) * scales.view(m, -1, 1)).view(m, n).to(dtype)


PEER = {F.E4M3_F32_128: deepep_cast, F.E4M3_UE8M0_128: deepgemm_ue8m0_cast, F.MXFP8: te_mxfp8_cast}


# ---------------------------------------------------------------------------
# Shared vectors
# ---------------------------------------------------------------------------

def vectors(dtype, rows=24, hidden=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    block = torch.arange(hidden) // 32
    x = x * torch.where(block % 5 == 0, 1e-3, torch.where(block % 7 == 0, 300.0, 1.0))
    x[0, :128] = 0.0                                  # a zero block (amax clamped / byte 0)
    x[1, 5], x[2, 40], x[3, 300] = float("nan"), float("inf"), float("-inf")
    x[4, 0], x[4, 1] = float("nan"), float("inf")     # both in one block
    x[5] = torch.linspace(-1e-6, 1e-6, hidden)        # e4m3 subnormals after scaling
    x[6, :64] = 448.0 * 2.0 ** torch.arange(-20, 44).float()  # powers of two around 448
    x[7, 7] = 1e-3                                    # values far below their block's amax
    if dtype == torch.float32:
        x[8, 0], x[8, 1] = 3.0e38, -1.0e-40           # huge, and a float32 subnormal
        x[9] = torch.rand(hidden, generator=g) * 1e-30
    return x.to(dtype)


def epx_quantize(x, fmt):
    if x.dtype == torch.bfloat16:
        q, s = epx.quantize(x.view(torch.int16).numpy().view(np.uint16), fmt, dtype="bf16")
    else:
        q, s = epx.quantize(x.numpy(), fmt)
    return torch.from_numpy(q), torch.from_numpy(s)


def assert_bytes_equal(got_u8, want_u8, what):
    """Equal bytes; e4m3 NaNs compare as NaN (torch keeps the sign, epx
    writes 0x7f as CUDA's satfinite conversion)."""
    nan_g, nan_w = (got_u8 & 0x7F) == 0x7F, (want_u8 & 0x7F) == 0x7F
    assert torch.equal(nan_g, nan_w), "%s: NaN positions differ" % what
    bad = (got_u8 != want_u8) & ~nan_g
    assert not bad.any(), "%s: %d bytes differ, first at %s" % (
        what, int(bad.sum()), bad.nonzero()[0].tolist())


def assert_scales_equal(got, want, what):
    if want.dtype == torch.float32:
        both_nan = torch.isnan(got) & torch.isnan(want)
        bad = (got.view(torch.int32) != want.view(torch.int32)) & ~both_nan
        assert not bad.any(), "%s: %d scales differ" % (what, int(bad.sum()))
    else:
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), what


@pytest.mark.parametrize("fmt", list(PEER))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [1024, 7168])
def test_quantize_matches_peer(fmt, dtype, hidden):
    x = vectors(dtype, hidden=hidden, seed=hidden + int(fmt))
    q, s = epx_quantize(x, fmt)
    wq, ws = PEER[fmt](x)
    assert_bytes_equal(q, wq.view(torch.uint8), "%s %s rows" % (fmt.name, dtype))
    assert_scales_equal(s, ws, "%s %s scales" % (fmt.name, dtype))


@pytest.mark.parametrize("fmt", [F.E4M3_F32_128, F.E4M3_UE8M0_128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_matches_deepep(fmt, dtype):
    x = vectors(dtype, seed=3)
    q, s = epx_quantize(x, fmt)
    name = "bf16" if dtype == torch.bfloat16 else "f32"
    got = epx.dequantize(q.numpy(), s.numpy(), fmt, dtype=name)
    got = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 \
        else torch.from_numpy(got)
    want = deepep_cast_back(q.view(FP8), s, dtype)
    same = (got.float() == want.float()) | (torch.isnan(got.float()) & torch.isnan(want.float()))
    assert same.all()


def test_nonfinite_rules():
    """What epx.h documents: a NaN or infinity makes DeepEP's blocks NaN on
    the way back; MXFP8 keeps NaN per element and saturates infinities."""
    x = torch.zeros(1, 1024)
    x[0, 1], x[0, 130], x[0, 2] = float("nan"), float("inf"), 1.0
    for fmt in (F.E4M3_F32_128, F.E4M3_UE8M0_128):
        q, s = epx_quantize(x, fmt)
        back = epx.dequantize(q.numpy(), s.numpy(), fmt)
        assert np.isnan(back[0, :256]).all() and (back[0, 256:] == 0).all()
    q, s = epx_quantize(x, F.MXFP8)
    back = epx.dequantize(q.numpy(), s.numpy(), F.MXFP8)
    assert np.isnan(back[0, 1]) and back[0, 2] == 1.0 and np.isinf(back[0, 130])
    assert int(s[0, 4]) == 254 and int(q[0, 130]) == 0x7E


def test_scale_shape_and_refusals():
    assert epx.fp8_scale_shape(F.E4M3_F32_128, 7168) == (56, np.dtype(np.float32))
    assert epx.fp8_scale_shape(F.E4M3_UE8M0_128, 7168) == (14, np.dtype(np.int32))
    assert epx.fp8_scale_shape(F.MXFP8, 7168) == (224, np.dtype(np.uint8))
    with pytest.raises(epx.InvalidArgumentError, match="multiple of 512"):
        epx.fp8_scale_shape(F.E4M3_UE8M0_128, 640)
    comm = epx.Comm.create_self()
    with pytest.raises(epx.InvalidArgumentError, match="not a multiple of 128"):
        comm.buffer(hidden=136, num_experts=4, max_top_k=2, max_tokens_per_rank=8,
                    dtype="bf16", fp8_format=F.E4M3_F32_128)
    comm.close()


# ---------------------------------------------------------------------------
# epx.torch.dispatch with fp8 rows
# ---------------------------------------------------------------------------

def torch_reference(xs_q, xs_s, src_rank, src_token, n):
    """Row i is its source token's bytes and scales; padding zero."""
    H, cols = xs_q[0].shape[1], xs_s[0].shape[1]
    q = torch.zeros(n, H, dtype=torch.uint8)
    s = torch.zeros(n, cols, dtype=xs_s[0].dtype)
    for i in range(n):
        r, t = int(src_rank[i]), int(src_token[i])
        if r >= 0:
            q[i], s[i] = xs_q[r][t].view(torch.uint8), xs_s[r][t]
    return q, s


def rank_dispatch(comm, rank, world, fmt, layout, exchange, quantize, T, H, E, K, device="cpu"):
    g = torch.Generator().manual_seed(100 * rank + int(fmt))
    inputs = []
    for r in range(world):
        x = vectors(torch.bfloat16, rows=T, hidden=H, seed=1000 * r + int(fmt))
        q, s = PEER[fmt](x)
        inputs.append((x, q, s))
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[0, :] = -1
    idx = idx.to(device)
    w = torch.rand(T, K, generator=g).to(device).requires_grad_()
    weighting = epx.Weighting.NONE if layout == epx.Layout.RANK_MAJOR else epx.Weighting.IN_COMBINE
    buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                         dtype=torch.bfloat16, fp8_format=fmt, layout=layout, exchange=exchange,
                         expert_alignment=2 if layout == epx.Layout.EXPERT_MAJOR else 1,
                         device=device)
    x, q, s = (t.to(device) for t in inputs[rank])
    if quantize:
        d = et.dispatch(buf, x, idx, w, weighting=weighting, quantize=True)
    else:
        d = et.dispatch(buf, q, idx, w, weighting=weighting, x_scales=s)
    assert d.recv_x.dtype == FP8 and d.recv_scales is not None
    src_rank, src_token = (t.cpu() for t in d.recv_source())
    n = d.recv_rows_host()
    want_q, want_s = torch_reference([i[1] for i in inputs], [i[2] for i in inputs],
                                     src_rank, src_token, n)
    assert_bytes_equal(d.recv_x[:n].view(torch.uint8).cpu(), want_q, "recv_x")
    assert torch.equal(d.recv_scales[:n].view(torch.uint8).cpu(), want_s.view(torch.uint8))
    # The experts dequantize; combine runs in the buffer's dtype, and the
    # routing weights still learn through recv_w.
    rows = d.recv_x.shape[0]
    out_rows = deepep_cast_back(d.recv_x, d.recv_scales, torch.bfloat16) if fmt != F.MXFP8 else \
        torch.zeros(rows, H, dtype=torch.bfloat16, device=device)
    out_rows = torch.nan_to_num(out_rows)
    scale = d.recv_w if d.recv_w.dim() == 1 else d.recv_w.sum(dim=1)
    y = et.combine(d, (out_rows.float() * scale.unsqueeze(1)).to(torch.bfloat16).contiguous())
    y.float().sum().backward()
    assert w.grad is not None
    del d, y
    buf.close()
    return 0


@pytest.mark.parametrize("fmt", list(PEER))
@pytest.mark.parametrize("layout", [epx.Layout.EXPERT_MAJOR, epx.Layout.RANK_MAJOR])
@pytest.mark.parametrize("quantize", [False, True])
def test_torch_dispatch_self(fmt, layout, quantize):
    comm = epx.Comm.create_self()
    rank_dispatch(comm, 0, 1, fmt, layout, epx.Exchange.DEDUP, quantize, T=9, H=1024, E=8, K=3)
    comm.close()


@pytest.mark.parametrize("fmt", list(PEER))
@pytest.mark.parametrize("exchange", [epx.Exchange.DEDUP, epx.Exchange.COLLECTIVE])
def test_torch_dispatch_two_ranks(fmt, exchange):
    def main(comm):
        return rank_dispatch(comm, comm.rank, comm.size, fmt, epx.Layout.EXPERT_MAJOR, exchange,
                             quantize=fmt != F.MXFP8, T=11, H=512, E=16, K=4)
    epx.run_local(2, main)


@pytest.mark.skipif(not (torch.cuda.is_available() and epx.has_cuda()),
                    reason="needs a GPU and a libepx with the CUDA backend")
@pytest.mark.parametrize("fmt", list(PEER))
@pytest.mark.parametrize("quantize", [False, True])
def test_torch_dispatch_gpu(fmt, quantize):
    """The one-GPU kernels give the PyTorch formulas' bytes too."""
    comm = epx.Comm.create_self()
    rank_dispatch(comm, 0, 1, fmt, epx.Layout.EXPERT_MAJOR, epx.Exchange.DEDUP, quantize, T=33,
                  H=7168, E=256, K=8, device="cuda")
    comm.close()


def test_torch_dispatch_column_major_scales():
    """DeepEP's tests pass scales column-major (x_scales.T.contiguous().T, as
    DeepGEMM wants them); the same bytes arrive as from row-major scales."""
    comm = epx.Comm.create_self()
    fmt, T, H, E, K = F.E4M3_F32_128, 12, 512, 8, 3
    buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                         dtype=torch.bfloat16, fp8_format=fmt)
    q, s = deepep_cast(vectors(torch.bfloat16, rows=T, hidden=H, seed=5))
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    col = s.T.contiguous().T
    assert not col.is_contiguous() and torch.equal(col.contiguous().view(torch.uint8), s.view(torch.uint8))
    a, b = (et.dispatch(buf, q, idx, w, x_scales=x_s) for x_s in (s, col))
    assert torch.equal(a.recv_x.view(torch.uint8), b.recv_x.view(torch.uint8))
    assert torch.equal(a.recv_scales.view(torch.uint8), b.recv_scales.view(torch.uint8))
    del a, b
    buf.close()
    comm.close()


def dispatch_again_case(device):
    """DeepEP's cached dispatch of fp8 x: x=(x_q, x_scales) along an earlier
    dispatch's handle gives the bytes of a fresh dispatch of those rows; so
    do quantize=True and rows of the buffer's dtype on the same handle."""
    comm = epx.Comm.create_self()
    fmt, T, H, E, K = F.E4M3_UE8M0_128, 10, 1024, 8, 3
    buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                         dtype=torch.bfloat16, fp8_format=fmt, expert_alignment=2, device=device)
    g = torch.Generator().manual_seed(9)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    x1, x2 = (vectors(torch.bfloat16, rows=T, hidden=H, seed=s) for s in (21, 22))
    (q1, s1), (q2, s2) = PEER[fmt](x1), PEER[fmt](x2)
    idx, w, x2, q1, s1, q2, s2 = (t.to(device) for t in (idx, w, x2, q1, s1, q2, s2))

    def same(a, b, what):
        assert a.dtype == b.dtype, what
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what

    d1 = et.dispatch(buf, (q1, s1), idx, w)  # DeepEP's tuple
    again = et.dispatch(buf, (q2, s2), handle=d1)
    fresh = et.dispatch(buf, q2, idx, w, x_scales=s2)
    same(again.recv_x, fresh.recv_x, "recv_x along the handle")
    same(again.recv_scales, fresh.recv_scales, "recv_scales along the handle")
    assert again.handle_id is d1.handle_id
    again_q = et.dispatch(buf, x2, handle=d1, quantize=True)
    fresh_q = et.dispatch(buf, x2, idx, w, quantize=True)
    same(again_q.recv_x, fresh_q.recv_x, "quantized along the handle")
    same(again_q.recv_scales, fresh_q.recv_scales, "quantized scales along the handle")
    rows = et.dispatch(buf, x2, handle=d1)  # the buffer's dtype on an fp8 handle
    same(rows.recv_x, et.dispatch(buf, x2, idx, w).recv_x, "bf16 rows along an fp8 handle")
    assert rows.recv_scales is None
    with pytest.raises(epx.InvalidArgumentError, match="x_scales is given but x is"):
        et.dispatch(buf, x2, handle=d1, x_scales=s2)
    with pytest.raises(epx.InvalidArgumentError, match="x_scales is None"):
        et.dispatch(buf, q2, handle=d1)
    with pytest.raises(epx.InvalidArgumentError, match="tuple of 3"):
        et.dispatch(buf, (q2, s2, s2), idx, w)
    with pytest.raises(epx.InvalidArgumentError, match="x_scales is given too"):
        et.dispatch(buf, (q2, s2), idx, w, x_scales=s2)
    with pytest.raises(epx.InvalidArgumentError, match="x_scales has shape"):
        et.dispatch(buf, q2, handle=d1, x_scales=s2[:-1])
    del d1, again, fresh, again_q, fresh_q, rows
    buf.close()
    comm.close()


def test_torch_dispatch_again_on_a_handle():
    dispatch_again_case("cpu")


@pytest.mark.skipif(not (torch.cuda.is_available() and epx.has_cuda()),
                    reason="needs a GPU and a libepx with the CUDA backend")
def test_gpu_torch_dispatch_again_on_a_handle():
    dispatch_again_case("cuda")


def test_torch_dispatch_refusals():
    comm = epx.Comm.create_self()
    buf = et.make_buffer(comm, hidden=256, num_experts=4, max_top_k=2, max_tokens_per_rank=4,
                         dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(epx.InvalidArgumentError, match="no fp8 format"):
        et.dispatch(buf, x, idx, torch.ones(4, 2), quantize=True)
    with pytest.raises(epx.InvalidArgumentError, match="x_scales is None"):
        et.dispatch(buf, x.to(FP8), idx, torch.ones(4, 2))
    buf.close()
    comm.close()


# ---------------------------------------------------------------------------
# epx.torch.MoE(fp8=...) against a float64 reference whose experts see the
# dequantized tokens (straight-through gradient to x)
# ---------------------------------------------------------------------------

def fp8_moe_reference(p, fmt):
    """test_torch's MoE reference with every expert fed x's fp8 round trip
    (epx's quantizer, checked above against the peers') and the gradient
    passed straight through it; routing on x itself."""
    from test_torch import swiglu
    router = p.router.clone().requires_grad_(True)
    w1, w2 = p.w1.clone().requires_grad_(True), p.w2.clone().requires_grad_(True)
    xs = [x.clone().requires_grad_(True) for x in p.x]
    outs, total = [], 0.0
    for x, g in zip(xs, p.g):
        q, s = epx.quantize(x.detach().float().numpy(), fmt)
        x_dq = torch.from_numpy(epx.dequantize(q, s, fmt)).double()
        x_ste = x + (x_dq - x).detach()
        prob = torch.softmax(x @ router.t(), dim=1)
        idx = torch.topk(prob.detach(), p.K, dim=1).indices
        w = prob.gather(1, idx)
        w = w / w.sum(1, keepdim=True)
        out = torch.zeros_like(x)
        for k in range(p.K):
            for e in range(p.E):
                rows = idx[:, k] == e
                if rows.any():
                    out = out.index_add(0, rows.nonzero()[:, 0],
                                        w[rows, k:k + 1] * swiglu(x_ste[rows], w1[e], w2[e]))
        total = total + (out * g).sum()
        outs.append(out.detach())
    total.backward()
    return dict(out=outs, grad_x=[x.grad for x in xs], router=router.grad, w1=w1.grad, w2=w2.grad)


def moe_fp8_against_reference(fmt, world, device, tol):
    """epx.torch.MoE(fp8=fmt) on `world` ranks against fp8_moe_reference:
    out, the gradients of x, the experts' weights and the router."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from test_torch import Problem, close, make_layer
    p = Problem(11 + int(fmt), world, T=24, H=512, F=64, E=4 * world, K=2)
    ref = fp8_moe_reference(p, fmt)

    def main(comm):
        m = make_layer(comm, p, epx.Weighting.IN_COMBINE, device=device, fp8=fmt)
        assert m.fp8_gemm == "dequantized"
        x = p.x[comm.rank].float().to(device).requires_grad_(True)
        out = m(x)
        (out * p.g[comm.rank].float().to(device)).sum().backward()
        r, El = comm.rank, p.E // comm.size
        close(out.detach().double().cpu(), ref["out"][r], tol, "out rank %d" % r)
        close(x.grad.double().cpu(), ref["grad_x"][r], tol, "grad_x rank %d" % r)
        close(m.w_gate_up.grad.double().cpu(), ref["w1"][r * El:(r + 1) * El].transpose(1, 2), tol,
              "w1 grad")
        close(m.w_down.grad.double().cpu(), ref["w2"][r * El:(r + 1) * El].transpose(1, 2), tol,
              "w2 grad")
        del out
        m.buffer.close()
        return m.router.weight.grad.double().cpu()
    grads = epx.run_local(world, main)
    router = sum(grads)
    assert router.abs().max() > 0, "the router got no gradient"
    close(router, ref["router"], tol, "router grad")


@pytest.mark.parametrize("fmt", list(PEER))
@pytest.mark.parametrize("world", [1, 2])
def test_moe_fp8_matches_reference(fmt, world):
    # test_torch's float32 tolerance against float64 (its absolute part
    # scales with the tensor)
    moe_fp8_against_reference(fmt, world, "cpu", (1e-5, 1e-4))


@pytest.mark.skipif(not (torch.cuda.is_available() and epx.has_cuda()),
                    reason="needs a GPU and a libepx with the CUDA backend")
@pytest.mark.parametrize("fmt", list(PEER))
def test_gpu_moe_fp8_matches_reference(fmt):
    """The same layer on one GPU (the quantizing dispatch kernel gives the
    CPU quantizer's bytes; test_torch's GPU float32 tolerance)."""
    moe_fp8_against_reference(fmt, 1, "cuda", (1e-4, 1e-3))


def test_moe_fp8_refusals():
    comm = epx.Comm.create_self()
    with pytest.raises(epx.InvalidArgumentError, match="IN_DISPATCH"):
        et.MoE(comm, 256, 32, 4, 2, max_tokens_per_rank=8, fp8=True,
               weighting=epx.Weighting.IN_DISPATCH)
    comm.close()
