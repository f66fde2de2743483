"""DeepEP's low-latency calls (V1 ``Buffer.low_latency_dispatch`` /
``low_latency_combine``) on epx's low-latency buffers (epx.torch.ll_dispatch
/ ll_combine): recv_x [E_local, W * num_max_dispatch_tokens_per_rank, H],
expert e's rows recv_x[e, :recv_count[e]], by source rank then token.

Where DeepEP and epx differ, and what is done about it:
- DeepEP takes the routing weights at combine, epx's low-latency handle at
  dispatch. combine therefore brings each row's weight to the expert's
  rank (an all-gather of the [T, K] routing over the group), scales the
  row there in float32 and rounds it to the payload dtype, and epx sums the
  scaled rows in float32 with weight 1: within one rounding of each product
  of DeepEP's result, not its bits.
- use_fp8: the rows travel in bfloat16 and are cast on the receiving rank
  with DeepEP's per-token, per-128-channel arithmetic (amax / 448, or its
  power of two with round_scale; UE8M0 bytes packed four to an int32 with
  use_ue8m0), scales column-major in the last two dimensions as DeepEP's.
  The values are DeepEP's; the bytes on the wire are twice fp8's.
- use_logfmt (DeepEP's 10-bit combine format) is refused; the wait-time
  statistics tensors are accepted and left unchanged (epx does not time
  its waits)."""
import torch
import torch.distributed as dist

import epx
import epx.torch as et

from . import _core
from ._core import check, unsupported
from .utils import EventHandle, EventOverlap

_FP8_MAX = 448.0


class LLHandle(tuple):
    """DeepEP's low-latency handle: (src_info [E_local, W * maxT] int32
    source token of each row (-1 past the count), layout_range [E_local, W]
    int64 (first row << 32 | rows) of each source rank's block,
    num_max_dispatch_tokens_per_rank, hidden, num_experts), epx's handle
    behind it."""

    def __new__(cls, items, epx_handle, buffer, num_tokens):
        h = super().__new__(cls, items)
        h.epx_handle, h.buffer, h.num_tokens = epx_handle, buffer, num_tokens
        return h


def _ll_buffer(owner, maxT, H, E, K, dtype, device):
    rt = owner._rt("low_latency_dispatch")
    key = (maxT, H, E, dtype, device)
    b = rt.ll_buffers.get(key)
    if b is None or b.dd_top_k < K:
        b = et.make_buffer(rt.comm, hidden=H, num_experts=E, max_top_k=max(K, 1),
                           max_tokens_per_rank=maxT, dtype=dtype, device=device, low_latency=1)
        b.dd_top_k = K
        rt.ll_buffers[key] = b
    return b


def _cast_fp8(x, round_scale, use_ue8m0):
    """DeepEP's per-token, per-128-channel cast: x [..., N, H] -> (x_q
    float8_e4m3fn, scales [..., N, H / 128] float32, or [..., N, H / 512]
    int32 of packed UE8M0 bytes), scales column-major in the last two dims."""
    *lead, N, H = x.shape
    blocks = x.float().reshape(*lead, N, H // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scale_inv = amax / _FP8_MAX
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (blocks / scale_inv.unsqueeze(-1)).reshape(*lead, N, H).to(torch.float8_e4m3fn)
    if use_ue8m0:
        exps = (scale_inv.view(torch.int32) >> 23).to(torch.uint8)          # [.., N, H/128]
        packed = exps.reshape(*lead, N, H // 512, 4).contiguous().view(torch.int32)[..., 0]
        s = packed
    else:
        s = scale_inv
    s = s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, s


@_core.opaque
def dispatch(owner, x, topk_idx, maxT, num_experts, cumulative_stats, wait_stats, use_fp8,
             round_scale, use_ue8m0, async_finish, return_recv_hook):
    fn = "Buffer.low_latency_dispatch"
    check(isinstance(x, torch.Tensor) and x.dim() == 2, fn, "x must be [num_tokens, hidden]")
    T, H = x.shape
    check(T <= maxT, fn, "%d tokens but num_max_dispatch_tokens_per_rank is %d", T, maxT)
    check(isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2
          and topk_idx.shape[0] == T and not topk_idx.is_floating_point(), fn,
          "topk_idx must be integer [num_tokens=%d, num_topk]", T)
    W = owner.group_size
    check(num_experts % W == 0, fn, "num_experts %d is not a multiple of %d ranks",
          num_experts, W)
    if use_ue8m0:
        assert round_scale, "use_ue8m0 needs round_scale=True"
    if use_fp8:
        check(H % (512 if use_ue8m0 else 128) == 0, fn, "hidden %d must be a multiple of %d "
              "for fp8", H, 512 if use_ue8m0 else 128)
    K = topk_idx.shape[1]
    b = _ll_buffer(owner, maxT, H, num_experts, K, x.dtype, x.device)
    idx = topk_idx.to(torch.int32)
    ones = (idx >= 0).to(torch.float32)
    recv_x, recv_count, h, hook = et.ll_dispatch(b, x.contiguous(), idx, ones,
                                                 return_recv_hook=return_recv_hook)
    E_local = num_experts // W
    src_info = torch.full((E_local, W * maxT), -1, dtype=torch.int32, device=x.device)
    layout_range = torch.zeros((E_local, W), dtype=torch.int64, device=x.device)
    handle = LLHandle((src_info, layout_range, maxT, H, num_experts), h, b, T)
    out = [recv_x]
    if use_fp8:
        q = torch.empty(recv_x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        cols = H // 512 if use_ue8m0 else H // 128
        s = torch.empty((E_local, cols, W * maxT), device=x.device,
                        dtype=torch.int32 if use_ue8m0 else torch.float32).transpose(1, 2)
        out = [q, s]

    def arrived():
        rank, token = et.ll_recv_source(b, h, x.device)
        src_rank = torch.as_tensor(rank, device=x.device).long().reshape(E_local, W * maxT)
        src_info.copy_(torch.as_tensor(token, device=x.device).reshape(E_local, W * maxT))
        ranks = torch.arange(W, device=x.device)
        hit = src_rank.unsqueeze(-1) == ranks                     # [E_local, rows, W]
        counts = hit.sum(dim=1)
        firsts = torch.where(hit, torch.arange(W * maxT, device=x.device)[None, :, None],
                             W * maxT).amin(dim=1)
        firsts = torch.where(counts > 0, firsts, 0)
        layout_range.copy_((firsts << 32) | counts)
        if use_fp8:
            qq, ss = _cast_fp8(recv_x, round_scale, use_ue8m0)
            out[0].copy_(qq)
            out[1].copy_(ss)
        if cumulative_stats is not None:
            cumulative_stats.add_(recv_count.to(cumulative_stats.dtype))

    if return_recv_hook:
        def recv_hook():
            hook()
            arrived()
        user_hook = recv_hook
    else:
        arrived()
        user_hook = None
    recv = (out[0], out[1]) if use_fp8 else out[0]
    event = EventOverlap(EventHandle(), (x, topk_idx)) if async_finish else EventOverlap(None)
    return recv, recv_count, handle, event, user_hook


def _row_weights(owner, handle, topk_idx, topk_weights, fn):
    """The weight of every received row [E_local, W * maxT] float32 (0 past
    the counts): the routing of every rank, gathered."""
    src_info, _, maxT, H, E = handle
    W = owner.group_size
    T = handle.num_tokens
    check(tuple(topk_idx.shape) == tuple(topk_weights.shape) and topk_idx.shape[0] == T, fn,
          "topk_idx and topk_weights must be [num_tokens=%d, num_topk] like the dispatch's", T)
    K = topk_idx.shape[1]
    dev = topk_weights.device
    idx = torch.full((maxT, K), -1, dtype=torch.int64, device=dev)
    w = torch.zeros((maxT, K), dtype=torch.float32, device=dev)
    idx[:T] = topk_idx
    w[:T] = topk_weights.float()
    runtime_comm = getattr(getattr(owner, "runtime", None), "comm", None)
    shared_gpu = dev.type == "cuda" and getattr(runtime_comm, "transport", None) in ("ipc", "shm")
    if W > 1 and (isinstance(owner.group, epx.Comm) or shared_gpu):
        # threads of one process (epx.run_local) or MPI: the comm's allgather, on the host;
        # so too processes sharing a GPU (their group's NCCL cannot run there)
        comm = owner.group if isinstance(owner.group, epx.Comm) else runtime_comm
        idx = torch.from_numpy(comm.allgather(idx.cpu().numpy())).to(dev)
        w = torch.from_numpy(comm.allgather(w.cpu().numpy())).to(dev)
    elif W > 1:
        idxs = [torch.empty_like(idx) for _ in range(W)]
        ws = [torch.empty_like(w) for _ in range(W)]
        dist.all_gather(idxs, idx, group=owner.group)
        dist.all_gather(ws, w, group=owner.group)
        idx, w = torch.stack(idxs), torch.stack(ws)
    else:
        idx, w = idx[None], w[None]
    dense = torch.zeros((W, maxT, E + 1), dtype=torch.float32, device=dev)
    dense.scatter_(2, torch.where(idx >= 0, idx, E), w)           # [W, maxT, E]
    rank, token = et.ll_recv_source(handle.buffer, handle.epx_handle, dev)
    E_local = E // W
    rank = torch.as_tensor(rank, device=dev).long().reshape(E_local, W * maxT)
    token = torch.as_tensor(token, device=dev).long().reshape(E_local, W * maxT)
    expert = owner.rank * E_local + torch.arange(E_local, device=dev)[:, None].expand_as(rank)
    valid = rank >= 0
    rw = dense[rank.clamp(min=0), token.clamp(min=0), expert]
    return torch.where(valid, rw, 0.0)


@_core.opaque
def combine(owner, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, wait_stats):
    fn = "Buffer.low_latency_combine"
    if not isinstance(handle, LLHandle):
        raise TypeError("epx.deep_ep: %s: handle is a %s; pass the handle "
                        "low_latency_dispatch returned" % (fn, type(handle).__name__))
    if use_logfmt:
        unsupported(fn, "use_logfmt (DeepEP's 10-bit LogFMT combine format): epx's combine "
                    "moves the payload dtype")
    if zero_copy:
        x = next_combine_buffer(owner, handle)
    b = handle.buffer
    check(isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(b.ll_shape()), fn,
          "x must be %s, not %s", list(b.ll_shape()),
          list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__)
    rw = _row_weights(owner, handle, topk_idx, topk_weights, fn)
    scaled = (x.float() * rw.unsqueeze(-1)).to(x.dtype)
    combined, hook = et.ll_combine(b, scaled, handle.epx_handle, out=out,
                                   return_recv_hook=return_recv_hook)
    event = EventOverlap(EventHandle(), (x,)) if async_finish else EventOverlap(None)
    return combined, event, hook


def next_combine_buffer(owner, handle):
    src_info, _, maxT, H, E = handle
    key = (maxT, H, E)
    t = owner._ll_next.get(key)
    if t is None:
        shape = tuple(handle.buffer.ll_shape())
        t = owner._ll_next[key] = torch.zeros(shape, dtype=et.torch_dtype(handle.buffer.dtype),
                                              device=src_info.device)
    return t
