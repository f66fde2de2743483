"""The low-latency decode mode from Python (epx.h, "Low-latency decode"):
Buffer.ll_dispatch / ll_combine / ll_complete and epx.torch.ll_dispatch /
ll_combine give DeepEP's shapes ([E_local, W * max_tokens, H] with per-expert
counts, or rank-major [W, max_tokens, H]), every row its source token's, in
the normal exchange's order, and the normal combine's bits; the two phases
equal one call; oversize steps, backward and the normal calls are refused
naming what to change."""
import numpy as np
import pytest

import epx

TIMEOUT = 20.0
E, K, H = 16, 4, 32


def routing(rank, T, E=E, K=K, H=H):
    """Rank's step: topk_idx [T, K], topk_w [T, K], x [T, H] bf16."""
    rng = np.random.default_rng(1000 + rank)
    idx = np.array([rng.permutation(E)[:K] for _ in range(T)], dtype=np.int32).reshape(T, K)
    w = rng.random((T, K), dtype=np.float32) + 0.1
    x = epx.to_bf16(rng.standard_normal((T, H)))
    return idx, w / w.sum(1, keepdims=True), x


def expert(rows, first):
    """Row i times (1 + ((first + i) % 5) / 4) in float32, rounded to bf16:
    the same rows numbered the same give the same bits in both layouts."""
    scale = 1.0 + ((first + np.arange(len(rows))) % 5).astype(np.float32) / 4.0
    return epx.to_bf16(epx.from_bf16(rows) * scale[:, None])


def step(comm, counts, layout, two_phase):
    rank, W = comm.rank, comm.size
    T = counts[rank % len(counts)]
    idx, w, x = routing(rank, T)
    weighting = epx.Weighting.NONE if layout == epx.Layout.RANK_MAJOR else epx.Weighting.IN_COMBINE
    fields = dict(dtype="bfloat16", hidden=H, num_experts=E, max_top_k=K, layout=layout,
                  max_tokens_per_rank=256)
    with comm.buffer(**fields) as normal:
        h = normal.dispatch_layout(idx, w, weighting=weighting)
        recv = normal.dispatch(h, x)
        src_rank, src_token = h.recv_source()
        counts_n, offsets = h.expert_counts()
        out_n = normal.combine(h, expert(recv, 0))
        h.release()
    with comm.buffer(low_latency=1, **fields) as b:
        assert b.max_tokens == 256
        recv_ll, count, hl = b.ll_dispatch(x, idx, w, weighting=weighting, send_only=two_phase)
        if two_phase:
            b.ll_complete(hl)
        groups, block = recv_ll.shape[0], recv_ll.shape[1]
        ll_rank, ll_token = (a.reshape(groups, block) for a in hl.recv_source())
        expert_out = epx.empty(recv_ll.shape, np.uint16)
        for g in range(groups):
            if layout == epx.Layout.RANK_MAJOR:
                sel = np.nonzero(src_rank == g)[0]
                first, n = (sel[0] if len(sel) else 0), len(sel)
            else:
                first, n = offsets[g], counts_n[g]
            assert count[g] == n
            assert np.array_equal(recv_ll[g, :n], recv[first:first + n])
            assert np.array_equal(ll_rank[g, :n], src_rank[first:first + n])
            assert np.array_equal(ll_token[g, :n], src_token[first:first + n])
            assert (ll_rank[g, n:] == -1).all()
            expert_out[g, :n] = expert(recv_ll[g, :n], first)
        out = b.ll_combine(hl, expert_out, send_only=two_phase)
        if two_phase:
            b.ll_complete(hl)
        assert np.array_equal(out, out_n)
        hl.release()
    return T


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("layout", [epx.Layout.EXPERT_MAJOR, epx.Layout.RANK_MAJOR])
@pytest.mark.parametrize("two_phase", [False, True])
def test_ll_matches_normal(W, layout, two_phase):
    counts = [7, 128, 0, 256, 1]
    got = epx.run_local(W, step, counts, layout, two_phase, timeout_seconds=TIMEOUT)
    assert got == [counts[r % 5] for r in range(W)]


def test_ll_refusals():
    with epx.Comm.create_self() as comm, comm.buffer(dtype="bfloat16", hidden=H, num_experts=E,
                                                     max_top_k=K, low_latency=1) as b:
        assert b.ll_shape() == (E, 256, H)
        idx, w, x = routing(0, 257)
        with pytest.raises(epx.EpxError, match="max_tokens_per_rank 256") as e:
            b.ll_dispatch(x, idx, w)
        assert e.value.status == epx.Status.ERROR_CAPACITY_EXCEEDED
        with pytest.raises(epx.EpxError, match=r"num_tokens is 300"):
            b.ll_dispatch(x, idx, w, num_tokens=300)
        recv, count, h = b.ll_dispatch(x[:8], idx[:8], w[:8])
        with pytest.raises(epx.EpxError, match="no backward pass") as e:
            b.combine_backward(h, x[:8], recv.reshape(-1, H))
        assert e.value.status == epx.Status.ERROR_UNSUPPORTED
        with pytest.raises(epx.EpxError, match="epx_ll_combine") as e:
            b.combine(h, recv.reshape(-1, H))
        with pytest.raises(epx.EpxError, match="nothing is pending"):
            b.ll_complete(h)
        h.release()
        # the count given apart from the routing's rows: only the first rows move
        r1, c1, h1 = b.ll_dispatch(x[:100], idx[:100], w[:100], num_tokens=5)
        r2, c2, h2 = b.ll_dispatch(x[:5], idx[:5], w[:5])
        assert np.array_equal(c1, c2) and c1.sum() == 5 * K
        for e_ in range(E):
            assert np.array_equal(r1[e_, :c1[e_]], r2[e_, :c2[e_]])
        h1.release(), h2.release()


def test_torch_ll():
    torch = pytest.importorskip("torch")
    import epx.torch as et

    def rank_main(comm):
        rank = comm.rank
        T = [3, 64][rank]
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, K, generator=g) + 0.1
        w = w / w.sum(1, keepdim=True)
        fields = dict(hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=64, dtype=torch.bfloat16)
        with et.make_buffer(comm, **fields) as normal:
            d = et.dispatch(normal, x, idx, w)
            n = int(d.recv_rows_host())
            out_n = et.combine(d, d.recv_x * 2)
            counts_n = d.counts_host()
            del d  # its handle would keep the buffer open
        with et.make_buffer(comm, low_latency=1, **fields) as b:
            recv_x, recv_count, handle, hook = et.ll_dispatch(b, x, idx, w, return_recv_hook=True)
            hook()
            assert recv_x.shape == (E // comm.size, comm.size * 64, H) and recv_x.dtype == torch.bfloat16
            assert torch.equal(recv_count.to(torch.int64), torch.as_tensor(counts_n).to(torch.int64))
            assert int(recv_count.sum()) == n
            out, hook = et.ll_combine(b, recv_x * 2, handle, return_recv_hook=True)
            hook()
            assert torch.equal(out, out_n)
            out1, _ = et.ll_combine(b, recv_x * 2, handle)
            assert torch.equal(out1, out_n)
            # the sources as tensors (on the device for a CUDA buffer), the handle's own
            src_rank, src_token = et.ll_recv_source(b, handle)
            want_rank, want_token = handle.recv_source()
            assert src_rank.shape == (E // comm.size * comm.size * 64,) and src_rank.dtype == torch.int32
            assert torch.equal(src_rank, torch.from_numpy(want_rank))
            assert torch.equal(src_token, torch.from_numpy(want_token))
            with pytest.raises(ValueError, match="device"):
                et.ll_recv_source(b, handle, device="cuda")
            handle.release()
            # the count as a tensor (on a CUDA buffer a device value)
            r1, c1, h1, _ = et.ll_dispatch(b, x, idx, w, num_tokens=torch.tensor([2], dtype=torch.int32))
            r2, c2, h2, _ = et.ll_dispatch(b, x[:2], idx[:2], w[:2])
            assert torch.equal(c1, c2)
            h1.release(), h2.release()
        return True

    assert epx.run_local(2, rank_main, timeout_seconds=TIMEOUT) == [True, True]


@pytest.mark.parametrize("W", [1, 2])
def test_ll_fp8(W):
    """Each fp8 row and its scales are the quantizer's of the row the bf16
    dispatch receives, quantized on the way or before."""
    H8 = 256

    def rank_main(comm):
        T = [5, 40][comm.rank % 2]
        idx, w, x = routing(comm.rank, T, H=H8)
        fields = dict(dtype="bfloat16", hidden=H8, num_experts=E, max_top_k=K, low_latency=1,
                      max_tokens_per_rank=64, fp8_format=epx.FP8Format.E4M3_F32_128)
        with comm.buffer(**fields) as b:
            recv, count, h = b.ll_dispatch(x, idx, w)
            q, s, count_q, hq = b.ll_dispatch_fp8(x, idx, w)
            xq, xs = epx.quantize(x, epx.FP8Format.E4M3_F32_128, "bfloat16")
            q2, s2, count_2, h2 = b.ll_dispatch_fp8(xq, idx, w, x_scales=xs, send_only=True)
            b.ll_complete(h2)
            assert np.array_equal(count, count_q) and np.array_equal(count, count_2)
            for e in range(len(count)):
                n = count[e]
                if not n:
                    continue
                want_q, want_s = epx.quantize(np.ascontiguousarray(recv[e, :n]), epx.FP8Format.E4M3_F32_128,
                                              "bfloat16")
                assert np.array_equal(q[e, :n], want_q) and np.array_equal(s[e, :n], want_s)
                assert np.array_equal(q2[e, :n], want_q) and np.array_equal(s2[e, :n], want_s)
            for hh in (h, hq, h2):
                hh.release()
        return int(count.sum())

    assert sum(epx.run_local(W, rank_main, timeout_seconds=TIMEOUT)) == (5 + (40 if W > 1 else 0)) * K


def test_torch_ll_cuda_graph():
    """One GPU: ll_dispatch / ll_combine captured once in a CUDA graph with
    the count a device tensor, replayed with new counts, each replay equal to
    the CPU backend on that count (needs a GPU and a CUDA libepx)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not epx.has_cuda():
        pytest.skip("needs a GPU and a libepx built with EPX_BUILD_CUDA")
    import epx.torch as et
    T, H8, E8, K8 = 128, 256, 64, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H8, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E8, generator=g)[:K8] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K8, generator=g) + 0.1
    w = w / w.sum(1, keepdim=True)
    fields = dict(hidden=H8, num_experts=E8, max_top_k=K8, max_tokens_per_rank=T, dtype=torch.bfloat16,
                  low_latency=1)
    with epx.Comm.create_self() as comm, et.make_buffer(comm, **fields) as cpu_b, \
            et.make_buffer(comm, device="cuda", **fields) as gpu_b:
        xc, ic, wc = x.cuda(), idx.cuda(), w.cuda()
        count = torch.full((1,), T, dtype=torch.int32, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):  # the warm-up sets the buffer's stream to the capture stream
            recv, rc, h, _ = et.ll_dispatch(gpu_b, xc, ic, wc, num_tokens=count)
            out, _ = et.ll_combine(gpu_b, recv, h)
            h.release()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            recv, rc, h, _ = et.ll_dispatch(gpu_b, xc, ic, wc, num_tokens=count)
            out, _ = et.ll_combine(gpu_b, recv, h)
        for n in (1, 77, T, 0):
            count.fill_(n)
            graph.replay()
            torch.cuda.synchronize()
            r2, c2, h2, _ = et.ll_dispatch(cpu_b, x[:n], idx[:n], w[:n])
            o2, _ = et.ll_combine(cpu_b, r2, h2)
            assert torch.equal(rc.cpu(), c2)
            for e in range(E8):
                assert torch.equal(recv[e, :int(c2[e])].cpu(), r2[e, :int(c2[e])])
            assert torch.equal(out[:n].cpu(), o2)
            assert bool((out[n:] == 0).all())
            h2.release()
        h.release()
