"""epx.deep_ep (DeepEP 2.1's Python API on epx) against a plain-PyTorch
reference of DeepEP's semantics, written from deep_ep's buffers/legacy.py,
buffers/elastic.py and its tests: get_dispatch_layout's counts exactly;
dispatch's rows by source rank then token, local expert ids with -1 and
weight 0 elsewhere, the received tokens per expert (aligned); cached
dispatch; combine's sum over ranks and its top-k weights' sum; V2's
expanded layout and its handle's prefix sums; the low-latency calls; the
gradients of a dispatch/combine pair wrapped as Megatron wraps them; the
refusals (NotImplementedError naming the feature) and bad inputs. On 1 and
2 processes under torchrun (gloo), and the install()/shim resolution of
``import deep_ep``.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_deep_ep.py
"""
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

H, E, K, T = 256, 8, 3, 12
# EPX_DEEP_EP_DEVICE=cuda runs the workers on the GPUs (bench/gpu/deep_ep_check.sh)
DEV = os.environ.get("EPX_DEEP_EP_DEVICE", "cpu")


def world(W, dtype=torch.float32, seed=7):
    """Every rank's x [T + r, H], topk_idx [T + r, K] (distinct experts,
    some -1), topk_weights: the same on every rank (seeded)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for r in range(W):
        n = T + r
        x = torch.randn(n, H, generator=g, device="cpu").to(dtype)
        idx = torch.stack([torch.randperm(E, generator=g, device="cpu")[:K] for _ in range(n)])
        drop = torch.rand(n, K, generator=g, device="cpu") < 0.2
        idx = torch.where(drop, -1, idx)
        idx[0] = -1                                    # a token with no expert
        w = torch.rand(n, K, generator=g, device="cpu")
        out.append((x.to(DEV), idx.to(DEV), w.to(DEV)))
    return out


def ref_dispatch(ranks, W, r):
    """DeepEP's normal-mode receive on rank r: rows by source rank, token."""
    E_local = E // W
    rows, ridx, rw, src = [], [], [], []
    for s, (x, idx, w) in enumerate(ranks):
        for t in range(x.shape[0]):
            mine = (idx[t] >= r * E_local) & (idx[t] < (r + 1) * E_local)
            if mine.any():
                rows.append(x[t])
                ridx.append(torch.where(mine, idx[t] - r * E_local, -1))
                rw.append(torch.where(mine, w[t], 0.0))
                src.append((s, t))
    return (torch.stack(rows), torch.stack(ridx), torch.stack(rw), src)


def ref_layout(idx, W):
    E_local = E // W
    in_rank = torch.zeros(idx.shape[0], W, dtype=torch.bool)
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                in_rank[t, e // E_local] = True
    per_expert = torch.tensor([(idx == e).sum().item() for e in range(E)], dtype=torch.int32)
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def check_v1(deep_ep, group, W, r, dtype):
    ranks = world(W, dtype)
    x, idx, w = ranks[r]
    b = deep_ep.Buffer(group, int(1e6), 0)
    per_rank, rdma, per_expert, in_rank, event = b.get_dispatch_layout(idx, E)
    ref_per_rank, ref_per_expert, ref_in_rank = ref_layout(idx, W)
    assert rdma is None and event.event is None
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32
    assert torch.equal(per_rank, ref_per_rank) and torch.equal(per_expert, ref_per_expert)
    assert torch.equal(in_rank, ref_in_rank)
    ref_x, ref_idx, ref_w, src = ref_dispatch(ranks, W, r)
    E_local = E // W
    for align in (1, 4):
        recv_x, recv_idx, recv_w, counts, handle, event = b.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
            expert_alignment=align)
        assert torch.equal(recv_x, ref_x)
        assert recv_idx.dtype == deep_ep.topk_idx_t and torch.equal(recv_idx, ref_idx)
        assert torch.equal(recv_w, ref_w)
        want = [int((ref_idx == e).sum()) for e in range(E_local)]
        assert counts == [-(-c // align) * align for c in want]
    # the handle: handle[0] the rank prefix matrix (DeepEP's check_data), recv_src_idx
    rank_prefix = handle[0]
    assert rank_prefix.shape == (W, W) and rank_prefix.dtype == torch.int32
    start = 0
    for s in range(W):
        end = int(rank_prefix[s][r])
        assert [t for (ss, t) in src if ss == s] == handle[3][start:end].tolist()
        start = end
    assert torch.equal(handle[4], in_rank)
    # without top-k: rows by is_token_in_rank, the counts still from num_tokens_per_expert
    rx2, ri2, rw2, counts2, h2, _ = b.dispatch(x, num_tokens_per_rank=per_rank,
                                               is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert)
    assert ri2 is None and rw2 is None and torch.equal(rx2, ref_x) and counts2 == want
    # num_worst_tokens: padded rows, idx -1 there, an empty list
    worst = W * (T + W)
    wx, wi, ww, wl, _, _ = b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert, topk_idx=idx,
                                      topk_weights=w, num_worst_tokens=worst)
    assert wl == [] and wx.shape[0] == worst and torch.equal(wx[:len(src)], ref_x)
    assert bool((wi[len(src):] == -1).all()) and torch.equal(wi[:len(src)], ref_idx)
    # cached dispatch: the payload along the handle, no layout
    before = deep_ep.stats()["layouts"]
    cx, none1, none2, none3, none4, ev = b.dispatch(x * 3, handle=handle, async_finish=True)
    assert (none1, none2, none3, none4) == (None, None, None, None)
    ev.current_stream_wait()
    assert torch.equal(cx, ref_x * 3) and deep_ep.stats()["layouts"] == before
    # combine: expert r's output is row * (r + 1); the sum over the token's ranks
    y = (recv_x.float() * (r + 1)).to(dtype)
    recv_w_mod = recv_w.clone()
    combined, combined_w, event = b.combine(y, handle, topk_weights=recv_w_mod,
                                            previous_event=b.capture())
    factor = torch.zeros(x.shape[0])
    for s in range(W):
        factor += in_rank[:, s].float() * (s + 1)
    ref = (x.float() * factor[:, None])
    tol = 0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(combined.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(combined_w, torch.where(idx >= 0, w, 0.0))
    # the weights summed over ranks including non-local slots (DeepEP's test fills them)
    filled = torch.where(recv_idx == -1, 1.0, recv_w)
    _, summed, _ = b.combine(y, handle, topk_weights=filled)
    local_slots = torch.where(idx >= 0, w, 0.0)
    expect = torch.zeros_like(local_slots)
    for s in range(W):
        own = (idx >= s * E_local) & (idx < (s + 1) * E_local)
        expect += in_rank[:, s:s + 1].float() * torch.where(own, w, 1.0)
    assert torch.allclose(summed, expect)
    # bias: added to the sum
    bias = torch.ones(x.shape[0], H, dtype=dtype)
    cb, _, _ = b.combine(y, handle, bias=(bias, bias))
    assert torch.allclose(cb.float(), ref + 2, rtol=tol or 1e-6, atol=tol or 1e-5)
    # fp8 (x, scales): rows and scales exactly, scales column-major accepted
    if dtype == torch.bfloat16:
        q = x.float().clamp(-400, 400).to(torch.float8_e4m3fn)
        s = (torch.arange(x.shape[0] * (H // 128), dtype=torch.float32).reshape(-1, H // 128)
             + 1).T.contiguous().T
        (fq, fs), fi, _, fl, fh, _ = b.dispatch((q, s), num_tokens_per_rank=per_rank,
                                               is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=idx,
                                               topk_weights=w)
        ref_q = torch.stack([world(W, dtype)[ss][0][t].float().clamp(-400, 400).to(
            torch.float8_e4m3fn) for (ss, t) in src])
        assert fq.dtype == torch.float8_e4m3fn and torch.equal(fq.view(torch.uint8),
                                                               ref_q.view(torch.uint8))
        assert fs.shape == (len(src), H // 128)
        (cq, cs), *_ = b.dispatch((q, s), handle=fh)
        assert torch.equal(cq.view(torch.uint8), fq.view(torch.uint8)) and torch.equal(cs, fs)
    b.runtime.close()


def check_v2(deep_ep, group, W, r, dtype):
    ranks = world(W, dtype, seed=11)
    x, idx, w = ranks[r]
    maxT = T + W
    eb = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=maxT, hidden=H, num_topk=K,
                               explicitly_destroy=True)
    ref_x, ref_idx, ref_w, src = ref_dispatch(ranks, W, r)
    E_local = E // W
    recv_x, recv_idx, recv_w, h, ev = eb.dispatch(x, topk_idx=idx, topk_weights=w,
                                                  num_experts=E)
    assert torch.equal(recv_x, ref_x) and torch.equal(recv_idx, ref_idx)
    assert torch.equal(recv_w, ref_w) and not h.do_expand
    assert h.num_recv_tokens == len(src)
    assert h.recv_src_metadata[:, 0].tolist() == [s * maxT + t for (s, t) in src]
    per_src = [sum(1 for (s, _) in src if s == q) for q in range(W)]
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == list(
        torch.tensor(per_src).cumsum(0))
    assert torch.equal(h.topk_idx, idx)
    for align in (1, 4):
        ex, ex_idx, ex_w, eh, _ = eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                              do_expand=True, expert_alignment=align)
        assert ex_idx is None and eh.do_expand
        counts = [int((ref_idx == e).sum()) for e in range(E_local)]
        start = 0
        psum = eh.psum_num_recv_tokens_per_expert.tolist()
        for e in range(E_local):
            n_e, k_e = (ref_idx == e).nonzero(as_tuple=True)   # by row, one slot per row
            assert torch.equal(ex[start:start + counts[e]], ref_x[n_e])
            assert torch.equal(ex_w[start:start + counts[e]], ref_w[n_e, k_e])
            assert psum[e] == start + counts[e]
            start += -(-counts[e] // align) * align
        assert eh.num_expanded_tokens == psum[-1]
        meta = eh.recv_src_metadata[:, 2:]
        for n in range(len(src)):
            for k in range(K):
                e = int(ref_idx[n, k])
                if e < 0:
                    assert meta[n, k] == -1
                else:
                    assert torch.equal(ex[meta[n, k]], ref_x[n])
        # expanded combine: the rows of a token summed (in k order), then over ranks
        y = (ex.float() * (r + 1)).to(dtype)
        comb, comb_w, _ = eb.combine(y, eh, topk_weights=ex_w)
        slots = torch.zeros(x.shape[0])
        for s in range(W):
            own = (idx >= s * E_local) & (idx < (s + 1) * E_local)
            slots += own.sum(1).float() * (s + 1)
        tol = 0 if dtype == torch.float32 else 3e-2
        assert torch.allclose(comb.float(), x.float() * slots[:, None], rtol=tol, atol=tol)
        assert torch.equal(comb_w, torch.where(idx >= 0, w, 0.0))
        # cached, with new weights (DeepSpeed's recompute replay)
        before = deep_ep.stats()["layouts"]
        cx, _, cw, ch, _ = eb.dispatch(x * 2, handle=eh, topk_weights=w * 2,
                                       do_expand=True)
        assert ch is eh and deep_ep.stats()["layouts"] == before
        assert torch.equal(cx, ex * 2) and torch.allclose(cw, ex_w * 2)
    comb, comb_w, _ = eb.combine(recv_x, h, topk_weights=recv_w)
    in_rank = torch.stack([((idx >= s * E_local) & (idx < (s + 1) * E_local)).any(1)
                           for s in range(W)], 1)
    assert torch.allclose(comb.float(), x.float() * in_rank.sum(1, keepdim=True).float(),
                          rtol=0 if dtype == torch.float32 else 2e-2)
    assert torch.equal(comb_w, torch.where(idx >= 0, w, 0.0))
    stats = torch.zeros(E_local, dtype=torch.int32)
    eb.dispatch(x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=stats)
    assert stats.tolist() == [int((ref_idx == e).sum()) for e in range(E_local)]
    assert eb.get_theoretical_num_sms(E, K) % 2 == 0
    assert eb.get_buffer_size_hint(group, maxT, H, K) % (2 << 20) == 0
    eb.barrier()
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        eb.dispatch(torch.zeros(maxT + 1, H, dtype=dtype),
                    topk_idx=torch.zeros(maxT + 1, K, dtype=torch.int64), num_experts=E)
    eb.destroy()


def check_low_latency(deep_ep, group, W, r):
    ranks = world(W, torch.bfloat16, seed=5)
    x, idx, w = ranks[r]
    maxT = T + W
    E_local = E // W
    b = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(maxT, H, W, E),
                       low_latency_mode=True, num_qps_per_rank=E_local, enable_shrink=True)
    b.clean_low_latency_buffer(maxT, H, E)
    for hook_mode in (False, True):
        recv_x, count, handle, event, hook = b.low_latency_dispatch(
            x, idx, maxT, E, use_fp8=False, return_recv_hook=hook_mode)
        if hook_mode:
            hook()
        assert recv_x.shape == (E_local, W * maxT, H) and count.dtype == torch.int32
        for e in range(E_local):
            ge = r * E_local + e
            want = [(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
                    if ge in ranks[s][1][t].tolist()]
            assert count[e] == len(want)
            got = recv_x[e, :len(want)]
            assert torch.equal(got, torch.stack([ranks[s][0][t] for (s, t) in want]))
            assert handle[0][e, :len(want)].tolist() == [t for (_, t) in want]
            for s in range(W):
                n = sum(1 for (ss, _) in want if ss == s)
                assert int(handle[1][e, s]) & 0xFFFFFFFF == n
        y = recv_x
        combined, event, hook = b.low_latency_combine(y, idx, w, handle,
                                                      return_recv_hook=hook_mode)
        if hook_mode:
            hook()
        ref = x.float() * torch.where(idx >= 0, w, 0.0).sum(1, keepdim=True)
        assert torch.allclose(combined.float(), ref, rtol=2e-2, atol=2e-2)
    # fp8: DeepEP's per-128 cast of the received rows
    for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
        xx = torch.cat([x, x], 1) if ue8m0 else x            # UE8M0: 4 scales an int32
        (q, s), count, handle, _, _ = b.low_latency_dispatch(
            xx, idx, maxT, E, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
        assert q.dtype == torch.float8_e4m3fn
        assert s.dtype == (torch.int32 if ue8m0 else torch.float32)
        assert s.shape == (E_local, W * maxT, xx.shape[1] // 512 if ue8m0 else H // 128)
        assert s.stride(1) == 1                          # column-major in the last two dims
        if not ue8m0:
            n = int(count[0])
            back = (q[0, :n].float().reshape(n, -1, 128) * s[0, :n, :, None]).reshape(n, H)
            plain, _, handle, _, _ = b.low_latency_dispatch(x, idx, maxT, E, use_fp8=False)
            assert torch.allclose(back, plain[0, :n].float(), rtol=0.07, atol=1e-2)
    buf = b.get_next_low_latency_combine_buffer(handle)
    assert buf.shape == (E_local, W * maxT, handle[3]) and buf.dtype == torch.bfloat16
    mask = torch.ones(W, dtype=torch.int32)
    b.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0] * W
    b.low_latency_update_mask_buffer(0, False)
    b.low_latency_clean_mask_buffer()
    if W == 1 or DEV == "cuda":  # a self comm, a CUDA buffer: no mask (shrink instead)
        with pytest.raises(NotImplementedError, match="shrink"):
            b.low_latency_update_mask_buffer(0, True)
    else:  # an shm comm keeps the mask: each rank masks its peer a moment, then cleans
        peer = (r + 1) % W
        b.low_latency_update_mask_buffer(peer, True)
        b.low_latency_query_mask_buffer(mask)
        assert mask.tolist() == [int(p == peer) for p in range(W)]
        b.low_latency_clean_mask_buffer()
        torch.distributed.barrier(group)  # every rank unmasked before the next epx call
    with pytest.raises(NotImplementedError, match="LogFMT"):
        b.low_latency_combine(y, idx, w, handle, use_logfmt=True)


class _Dispatch(torch.autograd.Function):
    """Megatron's FusedDispatch, as megatron/core/transformer/moe/fused_a2a.py
    wraps DeepEP: backward = combine of the gradient, with the weights'."""

    @staticmethod
    def forward(ctx, x, idx, probs, buffer, num_experts):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
        rx, ri, rp, counts, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        ctx.buffer, ctx.handle = buffer, handle
        return rx, ri, rp, handle

    @staticmethod
    def backward(ctx, g_x, g_i, g_p, g_h):
        gx, gp, _ = ctx.buffer.combine(g_x.contiguous(), ctx.handle, topk_weights=g_p.float())
        return gx, None, gp, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        return buffer.combine(x, handle=handle)[0]

    @staticmethod
    def backward(ctx, g):
        gx, *_ = ctx.buffer.dispatch(g.contiguous(), handle=ctx.handle)
        return gx, None, None


def check_gradients(deep_ep, group, W, r):
    """A layer's step through the wrapped calls against the same step in
    plain PyTorch (every rank's tokens on every rank)."""
    ranks = world(W, torch.float32, seed=3)
    E_local = E // W
    scale = torch.arange(1, E + 1, dtype=torch.float32)       # expert e scales by e + 1
    b = deep_ep.Buffer(group)
    x, idx, w = [t.clone() for t in ranks[r]]
    x.requires_grad_(True)
    w.requires_grad_(True)
    rx, ri, rp, handle = _Dispatch.apply(x, idx, w, b, E)
    own = scale[r * E_local:(r + 1) * E_local]
    gain = (rp * torch.where(ri >= 0, own[ri.clamp(min=0)], 0.0)).sum(1, keepdim=True)
    out = _Combine.apply(rx * gain, b, handle)
    g = torch.Generator(device="cpu").manual_seed(100 + r)
    grad = torch.randn(out.shape, generator=g, device="cpu").to(DEV)
    (out * grad).sum().backward()
    xr, ir, wr = [t.clone() for t in ranks[r]]
    xr.requires_grad_(True)
    wr.requires_grad_(True)
    gain_r = (wr * torch.where(ir >= 0, scale[ir.clamp(min=0)], 0.0)).sum(1, keepdim=True)
    ref = xr * gain_r
    (ref * grad).sum().backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, wr.grad, rtol=1e-5, atol=1e-5)
    assert float(w.grad.abs().sum()) > 0                      # the router learns


def check_errors(deep_ep, group, W, r):
    b = deep_ep.Buffer(group)
    x, idx, w = world(W)[r]
    per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, E)
    bad = torch.full_like(idx, E)
    if idx.device.type == "cpu":
        with pytest.raises(ValueError, match="topk_idx"):
            b.get_dispatch_layout(bad, E)
    else:
        # DeepEP's layout kernel counts an id outside [-1, E) nowhere and
        # raises nothing (reading the ids would wait for the device); the
        # dispatch refuses it, naming the route (epx's layout, collective)
        pr, _, pe, ir, _ = b.get_dispatch_layout(bad, E)
        assert int(pr.sum()) == 0 and int(pe.sum()) == 0 and not bool(ir.any())
        with pytest.raises(ValueError, match="topk_idx"):
            b.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                       topk_idx=bad, topk_weights=w)
    with pytest.raises(ValueError, match="topk_idx"):
        b.get_dispatch_layout(idx.float(), E)
    with pytest.raises(ValueError, match="is_token_in_rank"):
        b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank[:-1],
                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="topk_weights"):
        b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w.double())
    with pytest.raises(ValueError, match="x"):
        b.dispatch(x.to(torch.int32), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                   num_tokens_per_expert=per_expert, topk_idx=idx)
    with pytest.raises(ValueError, match="num_tokens_per_rank"):
        b.dispatch(x, topk_idx=idx)
    with pytest.raises(TypeError, match="handle"):
        b.combine(x, handle=(1, 2, 3))
    with pytest.raises(NotImplementedError, match="raw tensor"):
        b.get_local_buffer_tensor(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="Engram"):
        deep_ep.ElasticBuffer(group, num_bytes=1 << 21, num_cpu_bytes=1 << 21)
    eb = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=32)
    for name in ("engram_fetch", "pp_send", "agrs_new_session", "all_gather"):
        with pytest.raises(NotImplementedError, match="not offered"):
            getattr(eb, name)(None)
    with pytest.raises(AssertionError):
        b.destroy()                                  # explicitly_destroy not set, as DeepEP
    with pytest.raises(AssertionError):
        deep_ep.Buffer.set_num_sms(3)
    cfg = deep_ep.Buffer.get_dispatch_config(W)
    assert cfg.num_sms == deep_ep.Buffer.num_sms and cfg.get_nvl_buffer_size_hint(2 * H, W) > 0
    assert deep_ep.Buffer.get_combine_config(W).get_rdma_buffer_size_hint(2 * H, W) == 0


def shared_gpu():
    """More processes on this host than GPUs: they share them (NCCL refuses
    two ranks on one GPU, so the group is gloo and epx's comm the shm one,
    its CUDA buffers over CUDA IPC: epx.torch.comm_from_process_group)."""
    return DEV == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()


def worker(which):
    import torch.distributed as dist
    torch.set_num_threads(1)
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.set_default_device("cuda")
    dist.init_process_group("nccl" if DEV == "cuda" and not shared_gpu() else "gloo")
    import epx.deep_ep as deep_ep
    group = dist.group.WORLD
    W, r = dist.get_world_size(), dist.get_rank()
    if which in ("v1", "all"):
        check_v1(deep_ep, group, W, r, torch.float32)
        check_v1(deep_ep, group, W, r, torch.bfloat16)
    if which in ("v2", "all"):
        check_v2(deep_ep, group, W, r, torch.float32)
        check_v2(deep_ep, group, W, r, torch.bfloat16)
    if which in ("ll", "all") and DEV == "cpu":     # the LL calls on CUDA: bench_deep_ep.py
        check_low_latency(deep_ep, group, W, r)
    if which in ("grad", "all"):
        check_gradients(deep_ep, group, W, r)
    if which in ("errors", "all"):
        check_errors(deep_ep, group, W, r)
    dist.barrier()
    print("rank %d OK" % r, flush=True)
    dist.destroy_process_group()


@pytest.mark.parametrize("W", [1, 2])
def test_deep_ep_calls_match_deep_ep_semantics(W):
    torchrun(W, __file__, "all")


def _python(code, env=None):
    e = dict(os.environ, EPX_LIBRARY=epx.library_path)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "python")] + (
        [env.pop("PREPEND")] if env and "PREPEND" in env else []) + [e.get("PYTHONPATH", "")])
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          timeout=120)


def test_install_resolves_import_deep_ep_and_refuses_a_real_one(tmp_path):
    run = _python("import epx.deep_ep as d; d.install(); import deep_ep; "
                  "from deep_ep.utils import EventHandle, EventOverlap; "
                  "assert deep_ep.Buffer is d.Buffer and deep_ep.__version__ == '2.1.0'; "
                  "print('ok')")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr
    fake = tmp_path / "real" / "deep_ep"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    env = {"PREPEND": str(tmp_path / "real")}
    run = _python("import epx.deep_ep as d; d.install()", dict(env))
    assert run.returncode != 0 and "a real DeepEP is installed" in run.stderr
    run = _python("import epx.deep_ep as d; d.install(force=True); import deep_ep; "
                  "assert deep_ep.Buffer is d.Buffer; print('ok')", dict(env))
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr


def test_shim_on_pythonpath_and_the_runner(tmp_path):
    import epx.deep_ep as d
    code = "import deep_ep, epx.deep_ep as d; assert deep_ep is d; print('ok')"
    run = _python(code, {"PREPEND": d.shim_path()})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr
    fake = tmp_path / "real" / "deep_ep"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    both = os.pathsep.join([d.shim_path(), str(tmp_path / "real")])
    run = _python(code, {"PREPEND": both})
    assert run.returncode != 0 and "a real DeepEP" in run.stderr
    run = _python(code, {"PREPEND": both, "EPX_DEEP_EP": "force"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr
    script = tmp_path / "train.py"
    script.write_text("import sys, deep_ep, epx.deep_ep as d\nassert deep_ep is d\n"
                      "print('ran', sys.argv[1:])\n")
    run = _python("import runpy, sys; sys.argv = ['x', %r, '--flag']; "
                  "runpy.run_module('epx.deep_ep', run_name='__main__')" % str(script))
    assert run.returncode == 0 and "ran ['--flag']" in run.stdout, run.stderr


def test_the_helpers_deep_eps_tests_import():
    """deep_ep.utils.{math,envs,testing,event} and deep_ep.buffers.*, which
    DeepEP's own tests import beside the buffers."""
    run = _python(
        "import torch, epx.deep_ep as d; d.install()\n"
        "from deep_ep.utils.math import calc_diff, inplace_unique, per_token_cast_to_fp8, "
        "per_token_cast_back, create_grouped_scores, hash_tensor\n"
        "from deep_ep.utils.envs import init_dist, init_seed, dist_print\n"
        "from deep_ep.utils.testing import bench, bench_kineto\n"
        "from deep_ep.buffers.legacy import Buffer\n"
        "from deep_ep.buffers.elastic import ElasticBuffer, EPHandle\n"
        "x = torch.randn(3, 256).bfloat16()\n"
        "q, s = per_token_cast_to_fp8(x)\n"
        "assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)\n"
        "assert calc_diff(per_token_cast_back(q, s).float(), x.float()) < 1e-3\n"
        "assert calc_diff(x, x) == 0 and hash_tensor(x) == hash_tensor(x.clone())\n"
        "r = torch.tensor([[1, 1, 0, -1], [2, 3, 3, 2]])\n"
        "inplace_unique(r, 4)\n"
        "assert r.tolist() == [[1, 0, -1, -1], [3, 2, -1, -1]]\n"
        "g = create_grouped_scores(torch.ones(2, 4), torch.tensor([[0], [1]]), 2)\n"
        "assert g.tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]\n"
        "assert len(bench(lambda: None, 1, 3)) == 3\n"
        "assert Buffer is d.Buffer and ElasticBuffer is d.ElasticBuffer\n"
        "print('ok')\n")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr


if __name__ == "__main__":
    worker(sys.argv[1])
