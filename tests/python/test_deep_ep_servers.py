"""vLLM's and SGLang's DeepEP call sequences on epx.deep_ep, against a
plain-PyTorch reference.

Each check below replays, in structure, what one inference server does with
``deep_ep`` (our own code, written from reading theirs; no server is
imported or run):

- vLLM ``deepep_high_throughput``: DeepEPHTAll2AllManager's Buffer(**kwargs)
  and Buffer.set_num_sms; DeepEPHTPrepareAndFinalize's get_dispatch_layout /
  dispatch(x=..., config=get_dispatch_config(W) or None, async_finish=True)
  / EventOverlap waits / the local-to-global topk id remap / combine(x=...,
  topk_weights=None, config=get_combine_config(W)); bf16 and fp8 block
  (x, float32 per-128 scales) dispatch; destroy().
- vLLM ``deepep_low_latency``: DeepEPLLAll2AllManager's Buffer with
  get_low_latency_rdma_size_hint(keyword arguments), enable_shrink and the
  fault-tolerance mask query; DeepEPLLPrepareAndFinalize's
  low_latency_dispatch(..., use_fp8, round_scale=use_ue8m0=..., async_finish
  =False, return_recv_hook=True) / hook() / its dequant_fp8 of the float
  scales / batched experts / low_latency_combine(..., zero_copy=False,
  return_recv_hook=..., out=output).
- vLLM ``deepep_v2``: DeepEPV2All2AllManager's ElasticBuffer(**kwargs) and
  get_theoretical_num_sms; DeepEPV2PrepareAndFinalize's prefill
  (do_expand=True, do_cpu_sync=True: num_recv_tokens_per_expert_list,
  repeat_interleave'd ids, 1-D weights) and decode (do_expand=False,
  do_cpu_sync=False, a power-of-two num_max_tokens_per_rank: worst-case
  rows, psum_num_recv_tokens_per_scaleup_rank, the globalize of
  recv_topk_idx in place); fp8 block and MXFP8 (uint8 E8M0 per 32 packed
  four to an int32) scales; combine(x=..., async_with_compute_stream=...).
- SGLang ``--moe-a2a-backend deepep``: DeepEPBuffer.get_deepep_buffer's
  sizing (Config.get_nvl/rdma_buffer_size_hint of get_dispatch/combine_config
  or a JSON Config, get_low_latency_rdma_size_hint), Buffer(group, nvl,
  rdma, low_latency_mode=, num_qps_per_rank=, allow_mnnvl=True); the normal
  dispatcher (Buffer.capture(), get_dispatch_layout with async_finish and
  allocate_on_comm_stream, dispatch with expert_alignment 128 or 1 and
  config=, bf16 / float32 scales / column-major TMA-aligned packed UE8M0
  int32 scales, combine); the low-latency dispatcher (clean_low_latency_buffer
  on the switch from normal, low_latency_dispatch with return_recv_hook or
  async_finish, masked_m / expected_m, low_latency_combine(x=, topk_idx=,
  topk_weights=, handle=, ...) and its fork's overlap arguments).
- SGLang's DeepEPv2Dispatcher: ElasticBuffer(group, ..., sl_idx=0,
  prefer_overlap_with_compute=False), get_theoretical_num_sms / _qps, the
  masked decode (do_expand=True, do_cpu_sync=False: the slab from
  psum_num_recv_tokens_per_expert with expert_alignment 128) and the extend
  path (exact counts, slicing to psum_num_recv_tokens_per_scaleup_rank[-1],
  the idle rank's dummy token), use_tma_aligned_col_major_sf.
- The refusals of inputs the C calls would misread (scales' dtype and rows,
  weights' dtype, shapes), and DeepEP's Config checks.

Integers (counts, ids, prefix sums, fp8 bytes, scales) are compared bit for
bit; the received rows too; combined outputs within bfloat16 rounding of the
float32 reference on the same (dequantized) inputs. Rows past the counts
that the servers' expert kernels leave uninitialized are filled with NaN
here, so a combine that read them would fail.

Run on 1 and 2 processes under torchrun (gloo, as vLLM's cpu_group), on 1 and
2 threads of one process (an epx.Comm as the group), and on one GPU (the
same threads on CUDA; skipped without CUDA).

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python:tests/python \\
     python -m pytest tests/python/test_deep_ep_servers.py
"""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

E, K = 8, 3
FP8 = torch.float8_e4m3fn
NAN = float("nan")
DEV = os.environ.get("EPX_DEEP_EP_DEVICE", "cpu")


# ---------------------------------------------------------------------------
# the reference: data, experts, quantizers (the servers' formats), sums
# ---------------------------------------------------------------------------


def world(W, H, seed, tokens=None, dev="cpu"):
    """Every rank's (x bf16 [T_r, H], topk_ids int64 [T_r, K] distinct
    experts with some -1, topk_weights float32), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(W):
        n = tokens[r] if tokens is not None else 5 + 2 * r
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
            torch.empty(0, K, dtype=torch.int64)
        idx = torch.where(torch.rand(n, K, generator=g) < 0.2, -1, idx)
        if n:
            idx[0] = -1                                  # a token with no expert (SGLang's -1)
        w = torch.rand(n, K, generator=g)
        out.append((x.to(dev), idx.to(dev), w.to(dev)))
    return out


def experts(H, dev):
    """Expert e: x -> x * A[e] + B[e] (float32), the same on every rank."""
    g = torch.Generator().manual_seed(99)
    return (0.5 + torch.rand(E, H, generator=g)).to(dev), (0.1 * torch.randn(E, H, generator=g)).to(dev)


def apply_expert(AB, e, x32):
    A, B = AB
    return x32 * A[e] + B[e]


def ref_out(AB, x32, idx, w):
    """What a token's combined output is: sum over its experts of w * f_e(x)."""
    out = torch.zeros_like(x32)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        valid = (e >= 0)[:, None]
        out += torch.where(valid, w[:, k:k + 1] * (x32 * AB[0][e.clamp(min=0)] +
                                                   AB[1][e.clamp(min=0)]), 0.0)
    return out


def close(got, ref, what):
    """Combined bfloat16 outputs within bf16 rounding of the float32 sum."""
    got = got.float().cpu()
    ref = ref.float().cpu()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert torch.isfinite(got).all(), what
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=4e-2, msg=what)


def quant_block(x, block=128):
    """vLLM's / SGLang's per-token-group fp8 (Hopper): q, float32 scales
    [T, H / 128] row-major (amax / 448 per group)."""
    T, H = x.shape
    b = x.float().reshape(T, H // block, block)
    s = b.abs().amax(-1).clamp(min=1e-10) / 448.0
    q = (b / s[..., None]).reshape(T, H).to(FP8)
    return q, s


def e8m0_bytes(x, block):
    """Power-of-two scales (UE8M0 exponent bytes) per `block` columns, and
    the fp8 rows cast with them."""
    T, H = x.shape
    b = x.float().reshape(T, H // block, block)
    s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1).clamp(min=1e-10) / 448.0)))
    q = (b / s[..., None]).reshape(T, H).to(FP8)
    byte = (s.view(torch.int32) >> 23).to(torch.uint8)       # [T, H / block]
    return q, byte


def quant_ue8m0_tma(x):
    """SGLang's sglang_per_token_group_quant_fp8(x, 128, column_major_scales
    =True, scale_tma_aligned=True, scale_ue8m0=True) (Blackwell DeepGEMM):
    q, int32 [T, H / 512] (four UE8M0 bytes an int32), column-major with its
    column stride aligned to 4 tokens."""
    q, byte = e8m0_bytes(x, 128)
    T = x.shape[0]
    packed = byte.reshape(T, -1, 4).contiguous().view(torch.int32)[..., 0]   # [T, H / 512]
    tma = torch.empty_strided(packed.shape, (1, max(-(-T // 4) * 4, 1)), dtype=torch.int32,
                              device=x.device)
    tma.copy_(packed)
    return q, tma


def quant_mxfp8_packed(x):
    """vLLM's mxfp8 before a DeepEP v2 dispatch: uint8 E8M0 [T, H / 32]
    packed four to an int32 [T, H / 128] (_pack_mxfp8_scale)."""
    q, byte = e8m0_bytes(x, 32)
    return q, byte.contiguous().view(torch.int32)


def dequant(q, s, block):
    """fp8 rows [.., N, H] and scales [.., N, H / block] (float32, or bytes
    of E8M0 exponents) -> float32."""
    *lead, N, H = q.shape
    if s.dtype != torch.float32:
        s = torch.exp2(s.new_empty(s.shape).copy_(s).view(torch.uint8).float() - 127)
    s = s.contiguous().reshape(*lead, N, H // block, 1)
    return (q.float().reshape(*lead, N, H // block, block) * s).reshape(*lead, N, H)


def deq_sender(x, q=None, s=None, block=128):
    return x.float() if q is None else dequant(q, s, block)


# ---------------------------------------------------------------------------
# vLLM deepep_high_throughput
# ---------------------------------------------------------------------------


def vllm_ht(deep_ep, group, W, r, dev, fp8, tokens=None, dbo=False):
    H = 256
    ranks = world(W, H, seed=11, tokens=tokens, dev=dev)
    AB = experts(H, dev)
    E_local, offset = E // W, r * (E // W)
    # DeepEPHTAll2AllManager._make_all2all_kwargs (intranode) and get_handle
    kwargs = dict(group=group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0,
                  low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    buffer = deep_ep.Buffer(**kwargs)
    deep_ep.Buffer.set_num_sms(min(20, 20))
    available = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
    dcfg = deep_ep.Buffer.get_dispatch_config(W) if W in available else None
    ccfg = deep_ep.Buffer.get_combine_config(W) if W in available else None
    assert (dcfg is None) == (W == 1)

    x, ids, w = ranks[r]
    qs = [quant_block(xx) if fp8 else (None, None) for (xx, _, _) in ranks]
    token_data = (qs[r][0], qs[r][1]) if fp8 else x
    previous_event = buffer.capture() if dbo else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens,
     is_token_in_rank, event) = buffer.get_dispatch_layout(
        topk_idx=ids, num_experts=E, previous_event=previous_event, async_finish=False,
        allocate_on_comm_stream=False)
    (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list,
     handle, event) = buffer.dispatch(
        x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=ids, topk_weights=w,
        expert_alignment=1, config=dcfg, previous_event=previous_event,
        async_finish=not dbo, allocate_on_comm_stream=False)
    # _receiver
    assert (event.event is not None) == (not dbo)
    if event.event is not None:
        event.current_stream_wait()
    expert_x, expert_x_scale = token_data if fp8 else (token_data, None)
    assert expert_topk_ids.dtype == torch.int64
    ref_src = [(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
               if ((ranks[s][1][t] >= offset) & (ranks[s][1][t] < offset + E_local)).any()]
    if ref_src:
        if fp8:
            assert expert_x.dtype == FP8 and expert_x_scale.dtype == torch.float32
            assert torch.equal(expert_x.view(torch.uint8),
                               torch.stack([qs[s][0][t] for s, t in ref_src]).view(torch.uint8))
            assert torch.equal(expert_x_scale, torch.stack([qs[s][1][t] for s, t in ref_src]))
        else:
            assert torch.equal(expert_x, torch.stack([ranks[s][0][t] for s, t in ref_src]))
    assert expert_x.shape[0] == len(ref_src)
    local = torch.stack([ranks[s][1][t] for s, t in ref_src]) if ref_src else \
        torch.empty(0, K, dtype=torch.int64, device=dev)
    mine = (local >= offset) & (local < offset + E_local)
    assert torch.equal(expert_topk_ids, torch.where(mine, local - offset, -1))
    assert expert_num_tokens_per_expert_list == [int((local == offset + e).sum())
                                                 for e in range(E_local)]
    expert_topk_ids = torch.where(expert_topk_ids == -1, E - 1 if offset == 0 else 0,
                                  expert_topk_ids + offset)
    torch.tensor(expert_num_tokens_per_expert_list, dtype=torch.int32, device=dev)
    # the experts and TopKWeightAndReduceContiguous: expert_map sends non-local ids to -1
    x32 = dequant(expert_x, expert_x_scale, 128) if fp8 else expert_x.float()
    out = torch.zeros_like(x32)
    for k in range(K):
        g = expert_topk_ids[:, k]
        ok = ((g >= offset) & (g < offset + E_local))[:, None]
        out += torch.where(ok, expert_topk_weights[:, k:k + 1] *
                           apply_expert(AB, g.clamp(0, E - 1), x32), 0.0)
    fused_expert_output = out.to(torch.bfloat16)
    # _finalize
    previous_event = buffer.capture() if dbo else None
    output = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
    combined_x, _, event = buffer.combine(
        x=fused_expert_output, handle=handle, topk_weights=None, config=ccfg,
        previous_event=previous_event, async_finish=not dbo, allocate_on_comm_stream=False)
    if event.event is not None:
        event.current_stream_wait()
    output.copy_(combined_x, non_blocking=True)
    xs = deq_sender(x, *qs[r])
    close(output, ref_out(AB, xs, ids, w), "vllm ht fp8=%s" % fp8)
    buffer.destroy()


# ---------------------------------------------------------------------------
# vLLM deepep_low_latency
# ---------------------------------------------------------------------------


def ll_src(handle, W, e, n):
    """(source rank, token) of expert e's first n rows, from DeepEP's handle
    (src_info, layout_range)."""
    src_info, layout_range = handle[0], handle[1]
    out = [None] * n
    for s in range(W):
        v = int(layout_range[e, s])
        first, count = v >> 32, v & 0xFFFFFFFF
        for i in range(first, first + count):
            out[i] = (s, int(src_info[e, i]))
    assert None not in out
    return out


def vllm_ll(deep_ep, group, W, r, dev, mode, recv_hook=True, tokens=None):
    H, maxT = 2048, 8                  # vLLM's smallest SUPPORTED_HIDDEN_SIZES
    fp8, ue8m0 = mode != "bf16", mode == "ue8m0"
    ranks = world(W, H, seed=13, tokens=tokens, dev=dev)
    AB = experts(H, dev)
    E_local = E // W
    # DeepEPLLAll2AllManager._make_all2all_kwargs
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=maxT, hidden=H, num_ranks=W, num_experts=E)
    # DeepEP's LowLatencyLayout (csrc/legacy/config.hpp), computed here independently
    disp, comb = 16 + max(2 * H, H + H // 128 * 4), H // 128 * 4 + 2 * H
    total = 2 * (max(maxT * disp, E * maxT * comb) + E * maxT * max(disp, comb)
                 + (E * 4 + 127) // 128 * 128)
    assert num_rdma_bytes == (total + 128) // 128 * 128
    buffer = deep_ep.Buffer(**dict(
        group=group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True, num_qps_per_rank=E_local, allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False, explicitly_destroy=True, enable_shrink=True))
    x, ids, w = ranks[r]
    (expert_x, expert_num_tokens, handle, _, hook) = buffer.low_latency_dispatch(
        x, ids, maxT, E, use_fp8=fp8, round_scale=ue8m0, use_ue8m0=ue8m0,
        async_finish=False, return_recv_hook=True)
    hook()
    assert expert_num_tokens.dtype == torch.int32 and expert_num_tokens.shape == (E_local,)
    want = [[(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
             if (r * E_local + e) in ranks[s][1][t].tolist()] for e in range(E_local)]
    assert expert_num_tokens.tolist() == [len(v) for v in want]
    if fp8:
        q, scales = expert_x
        assert q.dtype == FP8 and q.shape == (E_local, W * maxT, H) and q.is_contiguous()
        cols = H // 512 if ue8m0 else H // 128
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
        assert scales.shape == (E_local, W * maxT, cols) and scales.stride(1) == 1  # column-major
        block = 128
        # vLLM's dequant_fp8 (float scales), or the unpacked UE8M0 exponents
        if not ue8m0:
            x32 = (q.to(torch.float32).view(E_local, -1, 128)
                   * scales.contiguous().view(E_local, -1, 1)).view(q.size())
        else:
            x32 = dequant(q, scales, block)
            ex = scales.contiguous().view(torch.uint8)     # powers of two at least amax / 448
            for e in range(E_local):
                n = len(want[e])
                rows = torch.stack([ranks[s][0][t] for s, t in ll_src(handle, W, e, n)]) \
                    if n else x.new_zeros(0, H)
                amax = rows.float().reshape(n, H // 128, 128).abs().amax(-1) / 448.0
                sc = torch.exp2(ex[e, :n].float() - 127)
                assert (sc >= amax).all() and (sc < 2 * amax.clamp(min=1e-30)).all()
    else:
        assert expert_x.dtype == torch.bfloat16 and expert_x.shape == (E_local, W * maxT, H)
        x32 = expert_x.view(-1, H).float().view(E_local, -1, H)
    # batched experts on each expert's first expert_num_tokens[e] rows; garbage after
    out = torch.full((E_local, W * maxT, H), NAN, dtype=torch.bfloat16, device=dev)
    for e in range(E_local):
        n = len(want[e])
        src = ll_src(handle, W, e, n)
        assert sorted(src) == want[e]
        if n:
            sent = torch.stack([ranks[s][0][t] for s, t in src])
            if fp8:
                torch.testing.assert_close(x32[e, :n], sent.float(), rtol=0.07, atol=2e-2)
            else:
                assert torch.equal(expert_x[e, :n], sent)
            out[e, :n] = apply_expert(AB, r * E_local + e, x32[e, :n]).to(torch.bfloat16)
    # _finalize: the weights applied in the combine
    output = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
    _, _, combine_hook = buffer.low_latency_combine(
        out, ids, w, handle, async_finish=False, zero_copy=False, return_recv_hook=recv_hook,
        out=output)
    assert (combine_hook is not None) == recv_hook
    if combine_hook is not None:
        combine_hook()
    # the reference on what each rank received (fp8: its dequantized rows)
    if fp8:
        sender = [dequant(*e8m0_q(xx, ue8m0)) for (xx, _, _) in ranks]
        xs = sender[r]
        close(output, ref_out(AB, xs, ids, w), "vllm ll %s" % mode)
    else:
        close(output, ref_out(AB, x.float(), ids, w), "vllm ll bf16")
    # zero copy (vLLM's TODO; DeepEP's get_next_low_latency_combine_buffer): the experts
    # write into the buffer the next combine reads, x is then not read
    nxt = buffer.get_next_low_latency_combine_buffer(handle)
    assert nxt.shape == (E_local, W * maxT, H) and nxt.dtype == torch.bfloat16
    nxt.copy_(out)
    again = torch.empty_like(output)
    _, _, zc_hook = buffer.low_latency_combine(
        torch.zeros_like(out), ids, w, handle, zero_copy=True, return_recv_hook=recv_hook,
        out=again)
    if zc_hook is not None:
        zc_hook()
    assert torch.equal(again, output)
    # query_active_mask / query_fault (enable_fault_tolerance)
    mask = torch.zeros(W, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(mask)
    last = torch.zeros_like(mask)
    assert not bool((mask != last).any())
    # clean_buffers: the raw RDMA buffer is not exposed (refused, named)
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
        buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    buffer.low_latency_clean_mask_buffer()
    buffer.destroy()


def e8m0_q(x, ue8m0):
    """The low-latency cast of one rank's rows, as DeepEP does it (per-128
    amax / 448, rounded up to a power of two with round_scale): (q, scales
    float32 [T, H / 128], 128)."""
    T, H = x.shape
    b = x.float().reshape(T, H // 128, 128)
    s = b.abs().amax(-1).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return (b / s[..., None]).reshape(T, H).to(FP8), s, 128


# ---------------------------------------------------------------------------
# vLLM deepep_v2
# ---------------------------------------------------------------------------


def vllm_v2(deep_ep, group, W, r, dev, prefill, quant, tokens=None):
    H, maxT = 256, 16
    ranks = world(W, H, seed=17, tokens=tokens, dev=dev)
    AB = experts(H, dev)
    E_local, offset = E // W, r * (E // W)
    # DeepEPV2All2AllManager._make_all2all_kwargs / get_handle
    buffer = deep_ep.ElasticBuffer(**dict(
        group=group, num_max_tokens_per_rank=maxT, hidden=H, num_topk=K,
        use_fp8_dispatch=quant is not None, allow_hybrid_mode=True,
        prefer_overlap_with_compute=True, allow_multiple_reduction=True,
        num_cpu_timeout_secs=1800, num_gpu_timeout_secs=1800, explicitly_destroy=True))
    num_sms = buffer.get_theoretical_num_sms(num_experts=E, num_topk=K)
    assert isinstance(num_sms, int) and num_sms >= 4 and num_sms % 2 == 0
    x, ids, w = ranks[r]
    qs = [(quant_block(xx) if quant == "block" else quant_mxfp8_packed(xx)) if quant else
          (None, None) for (xx, _, _) in ranks]
    block = 32 if quant == "mxfp8" else 128
    token_data = qs[r] if quant else x
    do_expand = do_cpu_sync = prefill
    nmt = None
    if not do_expand:
        n = max(rk[0].shape[0] for rk in ranks)      # dp_metadata.num_tokens_across_dp_cpu.max()
        nmt = min(1 << max(n - 1, 0).bit_length(), maxT)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x=token_data, topk_idx=ids, topk_weights=w, num_experts=E,
        num_max_tokens_per_rank=nmt, do_expand=do_expand, do_cpu_sync=do_cpu_sync,
        async_with_compute_stream=False)
    counts_list = handle.num_recv_tokens_per_expert_list
    psum = handle.psum_num_recv_tokens_per_scaleup_rank
    # _receiver
    if event.event is not None:
        event.current_stream_wait()
    expert_x, expert_x_scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    assert (expert_x_scale is not None) == (quant is not None)
    src = [(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
           if ((ranks[s][1][t] >= offset) & (ranks[s][1][t] < offset + E_local)).any()]
    N = len(src)
    assert psum.dtype == torch.int32 and psum.shape == (W,)
    assert psum.tolist() == torch.tensor([sum(1 for s, _ in src if s <= p)
                                          for p in range(W)]).tolist()
    meta = handle.recv_src_metadata
    mt = handle.num_max_tokens_per_rank
    got_src = [(int(g) // mt, int(g) % mt) for g in meta[:N, 0]]
    assert sorted(got_src) == src                    # DeepEP's order is not fixed: by metadata
    rows_sent = (lambda s, t: qs[s][0][t]) if quant else (lambda s, t: ranks[s][0][t])
    if expert_x_scale is not None:
        assert expert_x_scale.dtype == qs[r][1].dtype
    per_expert = [int(((torch.stack([ranks[s][1][t] for s, t in src]) if N else
                        torch.empty(0, K, dtype=torch.int64)) == offset + e).sum())
                  for e in range(E_local)]
    if not do_expand:
        assert counts_list == []                      # no CPU sync: no host counts
        assert handle.num_recv_tokens == W * nmt and expert_x.shape[0] == W * nmt
        assert recv_topk_idx.shape == (W * nmt, K) and recv_topk_idx.dtype == torch.int64
        for i, (s, t) in enumerate(got_src):
            assert torch.equal(expert_x[i].view(torch.uint8) if quant else expert_x[i],
                               rows_sent(s, t).view(torch.uint8) if quant else rows_sent(s, t))
            if quant:
                assert torch.equal(expert_x_scale[i], qs[s][1][t])
            sid = ranks[s][1][t]
            mine = (sid >= offset) & (sid < offset + E_local)
            assert torch.equal(recv_topk_idx[i], torch.where(mine, sid - offset, -1))
            assert torch.equal(recv_topk_weights[i], torch.where(mine, ranks[s][2][t], 0.0))
        # _globalize_recv_topk_idx (in place): local -> global, -1 past num_recv and elsewhere
        num_recv = int(psum[-1])
        val = recv_topk_idx
        g = val + offset
        row = torch.arange(val.shape[0], device=dev)[:, None]
        recv_topk_idx.copy_(torch.where((val >= 0) & (g < E) & (row < num_recv), g, -1))
        ids_for_experts, weights = recv_topk_idx, recv_topk_weights
        rows = expert_x.shape[0]
    else:
        assert counts_list == per_expert
        assert recv_topk_idx is None and recv_topk_weights.dim() == 1
        total = sum(counts_list)
        assert expert_x.shape[0] == total == handle.num_expanded_tokens
        slots = meta[:N, 2:]
        for i, (s, t) in enumerate(got_src):
            for k in range(K):
                p = int(slots[i, k])
                e = int(ranks[s][1][t][k])
                if offset <= e < offset + E_local:
                    assert p >= 0
                    assert sum(per_expert[:e - offset]) <= p < sum(per_expert[:e - offset + 1])
                    want = rows_sent(s, t)
                    assert torch.equal(expert_x[p].view(torch.uint8) if quant else expert_x[p],
                                       want.view(torch.uint8) if quant else want)
                    if quant:
                        assert torch.equal(expert_x_scale[p], qs[s][1][t])
                    assert recv_topk_weights[p] == ranks[s][2][t][k]
                else:
                    assert p == -1
        ids_for_experts = torch.repeat_interleave(
            torch.arange(E_local, dtype=torch.int64, device=dev) + offset,
            torch.tensor(counts_list, dtype=torch.int32, device=dev),
            output_size=total).unsqueeze(1) if total else \
            torch.empty(0, 1, dtype=torch.int64, device=dev)
        weights = recv_topk_weights.unsqueeze(1)
        rows = total
    # experts + TopKWeightAndReduceContiguous (padding rows: garbage the combine must skip)
    x32 = dequant(expert_x, expert_x_scale, block) if quant else expert_x.float()
    out = torch.zeros((rows, H), dtype=torch.float32, device=dev)
    for k in range(ids_for_experts.shape[1]):
        gk = ids_for_experts[:, k]
        ok = (gk >= 0)[:, None]
        out += torch.where(ok, weights[:, k:k + 1] * apply_expert(AB, gk.clamp(0, E - 1), x32),
                           0.0)
    fused = out.to(torch.bfloat16)
    if not do_expand:
        fused[int(psum[-1]):] = NAN
    output = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
    for combine_async in (False, True):
        combined_x, _, event = buffer.combine(x=fused, handle=handle, topk_weights=None,
                                              async_with_compute_stream=combine_async,
                                              allocate_on_comm_stream=combine_async)
        if event.event is not None:
            event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)
        xs = deq_sender(x, *qs[r], block=block)
        close(output, ref_out(AB, xs, ids, w), "vllm v2 prefill=%s %s" % (prefill, quant))
    buffer.destroy()


# ---------------------------------------------------------------------------
# SGLang --moe-a2a-backend deepep
# ---------------------------------------------------------------------------


def sglang_buffer(deep_ep, group, H, param_bytes, maxT, json_config):
    """DeepEPBuffer.get_deepep_buffer in DeepEPMode.AUTO (normal and low
    latency on one Buffer) and DeepEPConfig."""
    W = group.size if isinstance(group, epx.Comm) else group.size()
    if json_config:
        dcfg = deep_ep.Config(**json_config["normal_dispatch"])
        ccfg = deep_ep.Config(**json_config["normal_combine"])
        num_sms = json_config["normal_dispatch"]["num_sms"]
    else:
        dcfg = ccfg = None
        num_sms = deep_ep.Buffer.num_sms
    num_nvl_bytes, num_rdma_bytes = 0, 0
    hidden_bytes = H * param_bytes
    for config in (dcfg or deep_ep.Buffer.get_dispatch_config(W),
                   ccfg or deep_ep.Buffer.get_combine_config(W)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, W), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, W), num_rdma_bytes)
    num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(maxT, H, W, E),
                         num_rdma_bytes)
    assert num_nvl_bytes % 128 == 0 and num_rdma_bytes % 128 == 0 and num_nvl_bytes > 0
    num_qps_per_rank = max(num_sms, E // W)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)
    assert buffer.low_latency_mode
    return buffer, dcfg, ccfg


SGLANG_JSON = {"normal_dispatch": dict(num_sms=24, num_max_nvl_chunked_send_tokens=16,
                                       num_max_nvl_chunked_recv_tokens=256,
                                       num_max_rdma_chunked_send_tokens=6,
                                       num_max_rdma_chunked_recv_tokens=128),
               "normal_combine": dict(num_sms=24, num_max_nvl_chunked_send_tokens=6,
                                      num_max_nvl_chunked_recv_tokens=256,
                                      num_max_rdma_chunked_send_tokens=6,
                                      num_max_rdma_chunked_recv_tokens=128)}


def sglang(deep_ep, group, W, r, dev, quant, async_finish, deepgemm, json_config, tokens=None):
    H, maxT = 512, 16
    ranks = world(W, H, seed=19, tokens=tokens, dev=dev)
    AB = experts(H, dev)
    E_local, offset = E // W, r * (E // W)
    buffer, dcfg, ccfg = sglang_buffer(deep_ep, group, H, 1 if quant else 2, maxT,
                                       SGLANG_JSON if json_config else None)
    x, topk_ids, topk_weights = ranks[r]
    # --- normal: _DeepEPDispatcherImplNormal ---------------------------------------------
    topk_ids = topk_ids.to(torch.int64)
    qfun = {"f32": quant_block, "ue8m0": quant_ue8m0_tma}.get(quant)
    qs = [qfun(xx) if qfun else (None, None) for (xx, _, _) in ranks]
    hidden_states = qs[r] if quant else x
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buffer.get_dispatch_layout(
        topk_ids, E, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=previous_event is not None)
    align = 128 if deepgemm else 1
    (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle,
     event) = buffer.dispatch(
        hidden_states, topk_idx=topk_ids, topk_weights=topk_weights,
        num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
        previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=(previous_event is not None) and async_finish,
        expert_alignment=align, config=dcfg)
    event.current_stream_wait() if async_finish else ()
    if isinstance(recv_x, tuple):
        hidden, hidden_scale = recv_x
    else:
        hidden, hidden_scale = recv_x, None
    src = [(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
           if ((ranks[s][1][t] >= offset) & (ranks[s][1][t] < offset + E_local)).any()]
    assert hidden.shape[0] == len(src)
    if src:
        if quant:
            assert torch.equal(hidden.view(torch.uint8),
                               torch.stack([qs[s][0][t] for s, t in src]).view(torch.uint8))
            want_s = torch.stack([qs[s][1][t] for s, t in src])
            assert hidden_scale.dtype == want_s.dtype and torch.equal(hidden_scale, want_s)
            assert hidden_scale.is_contiguous()                # received row-major, as DeepEP's
        else:
            assert torch.equal(hidden, torch.stack([ranks[s][0][t] for s, t in src]))
    local = torch.stack([ranks[s][1][t] for s, t in src]) if src else \
        torch.empty(0, K, dtype=torch.int64, device=dev)
    mine = (local >= offset) & (local < offset + E_local)
    assert torch.equal(recv_topk_ids, torch.where(mine, local - offset, -1))
    want_w = torch.stack([ranks[s][2][t] for s, t in src]) if src else recv_topk_weights
    assert torch.equal(recv_topk_weights, torch.where(mine, want_w, 0.0))
    assert num_recv_tokens_per_expert == [-(-int((local == offset + e).sum()) // align) * align
                                          for e in range(E_local)]
    # the DeepEP-normal MoE runner: weighted sum of the local experts per row
    x32 = dequant(hidden, hidden_scale, 128) if quant else hidden.float()
    out = torch.zeros_like(x32)
    for k in range(K):
        e = recv_topk_ids[:, k]
        ok = (e >= 0)[:, None]
        out += torch.where(ok, recv_topk_weights[:, k:k + 1] *
                           apply_expert(AB, (e + offset).clamp(0, E - 1), x32), 0.0)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined_x, _, event = buffer.combine(
        out.to(torch.bfloat16), handle, async_finish=async_finish, previous_event=previous_event,
        allocate_on_comm_stream=previous_event is not None, config=ccfg)
    event.current_stream_wait() if async_finish else ()
    xs = deq_sender(x, *qs[r])
    close(combined_x, ref_out(AB, xs, topk_ids, topk_weights), "sglang normal %s" % quant)
    # --- low latency: _DeepEPDispatcherImplLowLatency ------------------------------------
    buffer.clean_low_latency_buffer(maxT, H, E)       # set_dispatch_mode_as_low_latency
    use_fp8 = quant is not None
    blackwell = quant == "ue8m0"
    return_recv_hook = not async_finish
    expected_m = (x.shape[0] * buffer.group_size * topk_ids.shape[1] + E) // E
    assert expected_m >= 1
    opts = dict(round_scale=blackwell, use_ue8m0=blackwell) if use_fp8 else dict()
    packed_recv_hidden, packed_recv_count, ll_handle, event, hook = buffer.low_latency_dispatch(
        x, topk_ids, maxT, E, use_fp8=use_fp8, async_finish=not return_recv_hook,
        return_recv_hook=return_recv_hook, **opts)
    hook() if return_recv_hook else event.current_stream_wait()
    masked_m = packed_recv_count
    want = [[(s, t) for s in range(W) for t in range(ranks[s][1].shape[0])
             if (offset + e) in ranks[s][1][t].tolist()] for e in range(E_local)]
    assert masked_m.dtype == torch.int32 and masked_m.tolist() == [len(v) for v in want]
    if use_fp8:
        q, scale = packed_recv_hidden
        assert scale.dtype == (torch.int32 if blackwell else torch.float32)
        assert scale.stride(1) == 1                    # column-major, DeepGEMM's masked layout
        x32 = dequant(q, scale, 128)
    else:
        x32 = packed_recv_hidden.float()
    out = torch.full((E_local, W * maxT, H), NAN, dtype=torch.bfloat16, device=dev)
    for e in range(E_local):
        n = int(masked_m[e])
        src = ll_src(ll_handle, W, e, n)
        assert sorted(src) == want[e]
        if n:
            sent = torch.stack([ranks[s][0][t] for s, t in src]).float()
            torch.testing.assert_close(x32[e, :n], sent, rtol=0.07 if use_fp8 else 0,
                                       atol=2e-2 if use_fp8 else 0)
            out[e, :n] = apply_expert(AB, offset + e, x32[e, :n]).to(torch.bfloat16)
    overlap_args_dict = {}
    combined, event, hook = buffer.low_latency_combine(
        x=out, topk_idx=topk_ids, topk_weights=topk_weights, handle=ll_handle,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook,
        **overlap_args_dict)
    hook() if return_recv_hook else event.current_stream_wait()
    xs = dequant(*e8m0_q(x, blackwell)) if use_fp8 else x.float()
    close(combined, ref_out(AB, xs, topk_ids, topk_weights), "sglang ll %s" % quant)
    # the fork's single-batch-overlap arguments: accepted when off, refused when on
    c2, _, _ = buffer.low_latency_combine(
        x=out, topk_idx=topk_ids, topk_weights=topk_weights, handle=ll_handle, overlap=False,
        packed_recv_count=packed_recv_count, comp_signal=None, block_m=64, threshold=0,
        num_sms=3)
    assert torch.equal(c2, combined)
    with pytest.raises(NotImplementedError, match="overlap"):
        buffer.low_latency_combine(x=out, topk_idx=topk_ids, topk_weights=topk_weights,
                                   handle=ll_handle, overlap=True,
                                   packed_recv_count=packed_recv_count,
                                   comp_signal=torch.zeros(E_local, dtype=torch.int32),
                                   block_m=64, threshold=1, num_sms=3)


def sglang_v2(deep_ep, group, W, r, dev, decode, quant, tokens=None):
    """SGLang's DeepEPv2Dispatcher (token_dispatcher/deepep_v2.py): decode
    takes the expanded layout without a CPU sync (the masked-GEMM slab from
    psum_num_recv_tokens_per_expert), extend the contiguous one with exact
    counts; fp8 scales row-major float32 (Hopper) or TMA-aligned
    column-major UE8M0 (Blackwell); an idle rank pads one dummy token on the
    contiguous path."""
    H, cap, align = 512, 16, 128
    ranks = world(W, H, seed=23, tokens=tokens, dev=dev)
    AB = experts(H, dev)
    E_local, offset = E // W, r * (E // W)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=cap, hidden=H, num_topk=K,
                                   use_fp8_dispatch=quant is not None, allow_hybrid_mode=False,
                                   sl_idx=0, prefer_overlap_with_compute=False)
    assert isinstance(buffer.num_bytes, int) and buffer.num_bytes > 0
    num_sms = buffer.get_theoretical_num_sms(E, K)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    x, topk_ids, topk_weights = ranks[r]
    topk_ids = topk_ids.to(torch.int64)
    masked = decode
    pad_empty = (not masked) and x.shape[0] == 0
    hidden_states = x
    if pad_empty:
        hidden_states = x.new_zeros((1, H))
        topk_ids = torch.arange(K, dtype=torch.int64, device=dev).unsqueeze(0)
        topk_weights = topk_weights.new_zeros((1, K))
    ue8m0 = quant == "ue8m0"
    if quant:
        dispatch_x = quant_ue8m0_tma(hidden_states) if ue8m0 else quant_block(hidden_states)
    else:
        dispatch_x = hidden_states
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        dispatch_x, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=E,
        num_max_tokens_per_rank=cap, expert_alignment=align, num_sms=num_sms, num_qps=num_qps,
        use_tma_aligned_col_major_sf=ue8m0, do_cpu_sync=not masked, do_expand=masked)
    if event.event is not None:
        event.current_stream_wait()
    hs, hs_scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    if hs_scale is not None and ue8m0:
        n = hs_scale.shape[0]
        assert hs_scale.stride() == (1, -(-n // 4) * 4)     # TMA-aligned column-major
    # what this rank's experts get, by (source rank, token, k)
    sent = [(s, t, k) for s in range(W) for t in range(ranks[s][1].shape[0]) for k in range(K)
            if offset <= int(ranks[s][1][t][k]) < offset + E_local]
    x32 = dequant(hs, hs_scale, 128) if quant else hs.float()
    if masked:
        assert recv_topk_idx is None and handle.num_recv_tokens_per_expert_list == []
        psum = handle.psum_num_recv_tokens_per_expert
        starts = [0] + [-(-int(psum[i - 1]) // align) * align for i in range(1, E_local)]
        counts = [int(psum[i]) - starts[i] for i in range(E_local)]
        assert counts == [sum(1 for (s, t, k) in sent if int(ranks[s][1][t][k]) == offset + e)
                          for e in range(E_local)]
        assert hs.shape[0] == handle.num_expanded_tokens      # the worst case, fixed
        out = torch.full((hs.shape[0], H), NAN, dtype=torch.float32, device=dev)
        for e in range(E_local):
            seg = slice(starts[e], starts[e] + counts[e])
            out[seg] = recv_topk_weights[seg, None] * apply_expert(AB, offset + e, x32[seg])
        combine_w = recv_topk_weights
    else:
        num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        recv_topk_idx = recv_topk_idx[:num_recv_tokens]
        recv_topk_weights = recv_topk_weights[:num_recv_tokens]
        x32 = x32[:num_recv_tokens]
        num_recv_tokens_per_expert = list(handle.num_recv_tokens_per_expert_list)
        assert len(num_recv_tokens_per_expert) == E_local
        out = torch.zeros((num_recv_tokens, H), dtype=torch.float32, device=dev)
        for k in range(K):
            e = recv_topk_idx[:, k]
            out += torch.where((e >= 0)[:, None], recv_topk_weights[:, k:k + 1] *
                               apply_expert(AB, (e + offset).clamp(0, E - 1), x32), 0.0)
        combine_w = recv_topk_weights
    combined_x, _, event = buffer.combine(out.to(torch.bfloat16), handle=handle,
                                          topk_weights=combine_w, num_sms=num_sms,
                                          num_qps=num_qps)
    if event.event is not None:
        event.current_stream_wait()
    if pad_empty:
        combined_x = combined_x[:0]
    xs = deq_sender(x, *(quant_ue8m0_tma(x) if ue8m0 else quant_block(x))) if quant and \
        x.shape[0] else x.float()
    close(combined_x, ref_out(AB, xs, ranks[r][1], ranks[r][2]),
          "sglang v2 decode=%s %s" % (decode, quant))


def bad_inputs(deep_ep, group, W, r, dev):
    """What the C calls would misread is refused with errors naming it."""
    H = 256
    x, ids, w = world(W, H, seed=29, dev=dev)[r]
    b = deep_ep.Buffer(group, 0, 0, low_latency_mode=True, explicitly_destroy=True,
                       enable_shrink=True)
    layout = b.get_dispatch_layout(ids, E)
    args = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2], topk_idx=ids, topk_weights=w)
    q, s = quant_block(x)
    with pytest.raises(ValueError, match="scales"):
        b.dispatch((q, s.to(torch.bfloat16)), **args)                 # 2-byte scales
    with pytest.raises(ValueError, match="scales"):
        b.dispatch((q, s[:-1]), **args)                               # a row short
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        b.dispatch((x, s), **args)                                    # bf16 rows as fp8
    with pytest.raises(ValueError, match="topk_weights"):
        b.dispatch(x, **dict(args, topk_weights=w.double()))
    _, _, _, _, handle, _ = b.dispatch(x, **args)
    with pytest.raises(ValueError, match="hidden"):
        b.combine(torch.zeros(x.shape[0], H // 2, dtype=x.dtype, device=dev), handle)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        b.low_latency_dispatch(x, ids, x.shape[0] - 1, E, use_fp8=False)
    recv, count, ll, _, _ = b.low_latency_dispatch(x, ids, 16, E, use_fp8=False)
    with pytest.raises(ValueError):
        b.low_latency_combine(recv[:, :-1], ids, w, ll)               # not [E_local, W*max, H]
    with pytest.raises(ValueError):
        b.low_latency_combine(recv, ids[:-1], w[:-1], ll)             # other tokens than dispatched
    with pytest.raises(ValueError, match="mask_status"):
        b.low_latency_query_mask_buffer(torch.zeros(W, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="Config"):
        deep_ep.Config(20, 6, 4, 6, 128)                              # nvl send >= recv
    # DeepEP rounds the RDMA receive chunk up to the send chunk
    c = deep_ep.Config(20, 24, 256, 6, 128)
    assert c.num_max_rdma_chunked_recv_tokens == 132
    b.destroy()


# ---------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------


def all_checks(deep_ep, group, W, r, dev, quick=False):
    idle = [5 + 2 * s for s in range(W - 1)] + [0] if W > 1 else None   # an idle DP rank
    for fp8 in (False, True):
        vllm_ht(deep_ep, group, W, r, dev, fp8)
    vllm_ht(deep_ep, group, W, r, dev, False, dbo=True)
    if idle:
        vllm_ht(deep_ep, group, W, r, dev, False, tokens=idle)
    for mode in ("bf16", "fp8", "ue8m0"):
        vllm_ll(deep_ep, group, W, r, dev, mode)
    vllm_ll(deep_ep, group, W, r, dev, "bf16", recv_hook=False, tokens=idle)
    for prefill in (True, False):
        for quant in (None, "block", "mxfp8"):
            vllm_v2(deep_ep, group, W, r, dev, prefill, quant)
        if idle:
            vllm_v2(deep_ep, group, W, r, dev, prefill, None, tokens=idle)
    for quant, async_finish, deepgemm, json_config in (
            (None, False, False, False), ("f32", True, True, False),
            ("ue8m0", False, True, True), (None, True, True, True)):
        sglang(deep_ep, group, W, r, dev, quant, async_finish, deepgemm, json_config)
    if idle:
        sglang(deep_ep, group, W, r, dev, None, False, True, False, tokens=idle)
    bad_inputs(deep_ep, group, W, r, dev)
    for decode in (True, False):
        for quant in (None, "f32", "ue8m0"):
            sglang_v2(deep_ep, group, W, r, dev, decode, quant)
        if idle:
            sglang_v2(deep_ep, group, W, r, dev, decode, None, tokens=idle)


def worker(which):
    import torch.distributed as dist
    torch.set_num_threads(1)
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    import epx.deep_ep as deep_ep
    W, r = dist.get_world_size(), dist.get_rank()
    # vLLM hands DeepEP its cpu_group (gloo); SGLang its EP group
    group = dist.new_group(backend="gloo") if DEV == "cpu" else dist.group.WORLD
    with torch.no_grad():
        all_checks(deep_ep, group, W, r, DEV)
    dist.barrier()
    print("rank %d OK" % r, flush=True)
    dist.destroy_process_group()


@pytest.mark.parametrize("W", [1, 2])
def test_vllm_and_sglang_call_patterns_under_torchrun(W):
    torchrun(W, __file__, "all", timeout=900)


def _threads(W, device):
    import epx.deep_ep as deep_ep
    import epx.torch as et

    def rank(comm):
        torch.set_num_threads(1)
        with torch.no_grad():
            all_checks(deep_ep, comm, W, comm.rank, device)
        return comm.rank

    assert et.run_local(W, rank, device=device, timeout_seconds=120) == list(range(W))


@pytest.mark.parametrize("W", [1, 2])
def test_vllm_and_sglang_call_patterns_in_process(W):
    _threads(W, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("W", [1, 2])
def test_vllm_and_sglang_call_patterns_on_one_gpu(W):
    _threads(W, "cuda")


if __name__ == "__main__":
    worker(sys.argv[1])
