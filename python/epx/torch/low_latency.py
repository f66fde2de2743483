"""Low-latency decode on a buffer made with low_latency=1 (epx.h,
"Low-latency decode"): ll_dispatch and ll_combine. Inference only: no
autograd (the library refuses backward there), so inputs that require grad
are refused (run under torch.no_grad())."""
import ctypes

import torch as _torch

from epx import Device, Weighting
from epx._lib import lib
from epx.errors import _check, _invalid
from .tensors import _F32, _I32, _on_stream, _ptr, _routing_tensor, _tensor, torch_dtype


def _ll_hook(buffer, handle, send_only):
    return (lambda: buffer.ll_complete(handle)) if send_only else None


def _ll_count(b, num_tokens, rows, fn):
    """(the step's count for the handle, the count's address or None): an
    int, or an int32 tensor of one element on the buffer's device (on CUDA
    read there by the kernels, so a captured graph replays with new counts;
    the handle's count is then the rows)."""
    if num_tokens is None:
        return rows, None
    if isinstance(num_tokens, _torch.Tensor):
        if num_tokens.numel() != 1:
            _invalid("%s: num_tokens is a tensor of %d elements (shape %s); pass an int or an "
                     "int32 tensor of one element", fn, num_tokens.numel(), tuple(num_tokens.shape))
        t = _tensor(num_tokens.reshape(1), fn, "num_tokens", _I32, (1,), b.device)
        if b.device == Device.CUDA:
            return rows, t.data_ptr(), t
        num_tokens = int(t)
    step = int(num_tokens)
    if not 0 <= step <= rows:
        _invalid("%s: num_tokens is %d; pass a count in [0, %d] (the rows of x)", fn, step, rows)
    count = ctypes.c_int32(step)
    return step, ctypes.addressof(count), count


def _no_grad(fn, **tensors):
    """Refuses inputs that want a gradient: the low-latency path has no
    backward, and a result silently cut from the graph would train
    nothing."""
    if not _torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, _torch.Tensor) and t.requires_grad:
            _invalid("%s: %s requires grad, but the low-latency path has no backward (inference "
                     "only); run it under torch.no_grad() or torch.inference_mode(), pass "
                     "%s.detach(), or train with epx.torch.dispatch / combine", fn, name, name)


def ll_dispatch(buffer, x, topk_idx, topk_w=None, *, num_tokens=None,
                weighting=Weighting.IN_COMBINE, return_recv_hook=False):
    """DeepEP's low_latency_dispatch on a low-latency buffer
    (make_buffer(..., low_latency=1)): x [T, H] -> (recv_x, recv_count,
    handle, hook). recv_x has buffer.ll_shape() ([E_local, W * max_tokens, H]
    expert-major; [W, max_tokens, H] rank-major, with weighting NONE) in the
    buffer's dtype; recv_count [E_local] int32 (rank-major: rows per source
    rank); expert e's rows are recv_x[e, :recv_count[e]], in the normal
    exchange's order. handle (an epx.Handle) drives ll_combine and gives
    recv_source(); release it when done. num_tokens: the step's count when x
    and the routing hold more rows, an int or an int32 tensor of one element
    (on a CUDA buffer read on the device: a captured CUDA graph replays with
    the count of the moment; combine's output then has T rows, zeros past the
    count). return_recv_hook: the send runs now and hook() completes it
    (epx_ll_complete); read recv_x after hook(); else hook is None. CUDA
    tensors run on PyTorch's current stream."""
    fn = "epx.torch.ll_dispatch"
    _no_grad(fn, x=x, topk_w=topk_w)
    b = buffer
    dt = torch_dtype(b.dtype)
    if not isinstance(x, _torch.Tensor) or x.dim() != 2:
        _tensor(x, fn, "x", dt, (None, b.hidden), b.device)
    T = x.shape[0]
    x = _tensor(x, fn, "x", dt, (T, b.hidden), b.device, align=16)
    idx = _routing_tensor(topk_idx, fn, "topk_idx", _I32, (T, None), b.device, high=b.num_experts)
    K = idx.shape[1]
    w = _routing_tensor(topk_w, fn, "topk_w", _F32, (T, K), b.device,
                        optional=weighting == Weighting.NONE)
    step, count_address, *keep = _ll_count(b, num_tokens, T, fn)
    _on_stream(b, x.device)
    shape = b.ll_shape()
    recv_x = _torch.empty(shape, dtype=dt, device=x.device)
    recv_count = _torch.empty((shape[0],), dtype=_I32, device=x.device)
    h = b._ll_dispatch(step, K, _ptr(idx), _ptr(w), weighting, count_address, _ptr(x),
                       recv_x.data_ptr(), recv_count.data_ptr(), return_recv_hook, rows=T)
    return recv_x, recv_count, h, _ll_hook(b, h, return_recv_hook)


def ll_combine(buffer, x, handle, *, out=None, return_recv_hook=False):
    """DeepEP's low_latency_combine: x (the expert outputs, buffer.ll_shape())
    -> (combined [T, H], hook): each token's weighted sum, the bits of the
    normal combine on the same routing. return_recv_hook as in ll_dispatch."""
    fn = "epx.torch.ll_combine"
    _no_grad(fn, x=x)
    b = buffer
    dt = torch_dtype(b.dtype)
    x = _tensor(x, fn, "x", dt, b.ll_shape(), b.device, align=16)
    T = handle.num_tokens
    if out is None:
        out = _torch.empty((T, b.hidden), dtype=dt, device=x.device)
    elif _tensor(out, fn, "out", dt, (T, b.hidden), b.device, align=16).data_ptr() != out.data_ptr():
        _invalid("%s: out must be contiguous and 16-byte aligned (it is written in place)", fn)
    _on_stream(b, x.device)
    call = lib.epx_ll_combine_send if return_recv_hook else lib.epx_ll_combine
    _check(call(b._handle_ptr(fn), handle._use(b, fn), _ptr(x), _ptr(out)))
    return out, _ll_hook(b, handle, return_recv_hook)


def ll_recv_source(buffer, handle, device=None):
    """(src_rank, src_token) of each row of a low-latency dispatch's fixed
    shape (buffer.ll_shape() without H, flattened: DeepEP's src_info), [N]
    int32 each on the buffer's device, -1 past the counts
    (epx_handle_recv_source; on CUDA with no host wait). Read it after the
    dispatch's hook where it returned one. device: the torch device of the
    dispatch's tensors (by default the current CUDA device for a CUDA
    buffer)."""
    fn = "epx.torch.ll_recv_source"
    b = buffer
    shape = b.ll_shape()
    n = shape[0] * shape[1]
    dev = device if device is not None else (
        _torch.device("cuda", _torch.cuda.current_device()) if b.device == Device.CUDA else "cpu")
    if (_torch.device(dev).type == "cuda") != (b.device == Device.CUDA):
        _invalid("%s: device %s is not where the buffer's rows are (%s)", fn, dev, b.device.name)
    rank = _torch.empty((n,), dtype=_I32, device=dev)
    token = _torch.empty((n,), dtype=_I32, device=dev)
    _on_stream(b, rank.device)
    _check(lib.epx_handle_recv_source(handle._use(b, fn), _ptr(rank), _ptr(token)))
    return rank, token
