"""epx for PyTorch: routing, dispatch and combine as autograd functions.

Tensors are passed by address (``data_ptr``): CPU tensors on a CPU buffer,
CUDA tensors on a CUDA buffer (a libepx built with EPX_BUILD_CUDA; every call
runs on PyTorch's current stream). A layer::

    import epx, epx.torch as et
    r = et.route(logits, top_k=2)                     # differentiable in r.topk_w
    h = et.dispatch_layout(buffer, r.topk_idx, r.topk_w)
    recv_x = et.dispatch(h, x)                        # [N, H], grouped by local expert
    counts, offsets = et.expert_counts(h)
    expert_out = my_experts(recv_x, counts, offsets)
    out = et.combine(h, expert_out)                   # sum_k w[t,k] * expert_out(t,k)
    out.backward(grad)  # -> x.grad, logits.grad (through grad_w: the router learns)

The backward of each function replays the forward's handle (no new layout).
With Weighting.IN_COMBINE (the default) combine's backward returns the weights'
gradient to the router's topk_w; with IN_DISPATCH dispatch's backward does.
dispatch, combine and their backward passes are collective: every rank must
run the same graph. This module needs torch; ``import epx`` alone does not.
"""
import collections
import ctypes

import torch as _torch

import epx as _epx
from epx import _lib
from epx import DType, Device, Status, Weighting

__all__ = ["route", "dispatch_layout", "dispatch", "combine", "expert_counts", "recv_routing",
           "recv_source", "TorchRouteResult", "epx_dtype"]

_lib_handle = _lib.lib

_DTYPES = {_torch.float32: DType.FLOAT32, _torch.bfloat16: DType.BFLOAT16,
           _torch.float16: DType.FLOAT16}
_TORCH_OF = {v: k for k, v in _DTYPES.items()}


def epx_dtype(dtype):
    """The epx DType of a torch dtype (float32, bfloat16, float16)."""
    if dtype not in _DTYPES:
        raise TypeError("epx.torch: %s is not an epx payload dtype; use float32, bfloat16 or "
                        "float16" % dtype)
    return _DTYPES[dtype]


def _device_kind(buffer_device):
    return "cuda" if buffer_device == Device.CUDA else "cpu"


def _check_device(t, fn, name, buffer_device):
    want = _device_kind(buffer_device)
    if t.device.type != want:
        if t.device.type == "cuda" and not _epx.has_cuda():
            _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: %s is a CUDA tensor but this libepx (%s) "
                         "has no CUDA backend; build it with -DEPX_BUILD_CUDA=ON", fn, name,
                         _epx.library_path)
        _epx._invalid("%s: %s is on %s but the buffer is a %s buffer; move it with .to(%r)", fn,
                      name, t.device, want.upper(), want)


def _tensor(t, fn, name, dtype, shape, buffer_device, align=4, optional=False):
    """A tensor argument made usable by the library: checked for type, dtype,
    shape and device; made contiguous and aligned (copying) when it is not."""
    if t is None:
        if optional:
            return None
        _epx._invalid("%s: %s is None; pass a %s tensor of shape %s", fn, name, dtype,
                      _epx._shape_text(shape))
    if not isinstance(t, _torch.Tensor):
        _epx._invalid("%s: %s is a %s; pass a torch.Tensor", fn, name, type(t).__name__)
    _check_device(t, fn, name, buffer_device)
    if t.dtype != dtype:
        _epx._invalid("%s: %s has dtype %s; pass %s (convert with .to(%s))", fn, name, t.dtype,
                      dtype, dtype)
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        _epx._invalid("%s: %s has shape %s; expected %s", fn, name, list(t.shape),
                      _epx._shape_text(shape))
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % align:
        t = t.clone()
    return t


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


def _on_stream(buffer, device):
    """CUDA buffers run on PyTorch's current stream of the tensors' device."""
    if buffer.device == Device.CUDA:
        buffer.set_stream(_torch.cuda.current_stream(device).cuda_stream)


def _buffer_dtype(buffer):
    return _TORCH_OF[buffer.dtype]


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


TorchRouteResult = collections.namedtuple("TorchRouteResult", [
    "topk_idx", "topk_w", "locations", "expert_counts", "aux_loss", "z_loss", "capacity",
    "nonfinite_tokens"])
TorchRouteResult.__doc__ = """What :func:`route` returns: topk_idx int32 [T, K], topk_w
float32 [T, K], locations int32 [T, K], expert_counts int32 [E], aux_loss and
z_loss (0-d float32), capacity and nonfinite_tokens (ints). topk_w, aux_loss
and z_loss are differentiable with respect to the logits."""


class _Route(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, config, info):
        T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
        dev = logits.device
        i32, f32 = dict(dtype=_torch.int32, device=dev), dict(dtype=_torch.float32, device=dev)
        idx, w, loc = (_torch.empty((T, max(K, 0)), **i32), _torch.empty((T, max(K, 0)), **f32),
                       _torch.empty((T, max(K, 0)), **i32))
        counts = _torch.empty((max(E, 0),), **i32)
        aux, z = _torch.empty((1,), **f32), _torch.empty((1,), **f32)
        out = _lib.RouteOutput()
        out.topk_idx, out.topk_w, out.locations = _ptr(idx), _ptr(w), _ptr(loc)
        out.expert_counts, out.aux_loss, out.z_loss = _ptr(counts), aux.data_ptr(), z.data_ptr()
        _epx._check(_lib_handle.epx_route(ctypes.byref(config), T, _ptr(logits), _ptr(bias),
                                          ctypes.byref(out)))
        info["capacity"], info["nonfinite_tokens"] = int(out.capacity), int(out.nonfinite_tokens)
        ctx.config = config
        ctx.save_for_backward(logits, bias, idx)
        ctx.mark_non_differentiable(idx, loc, counts)
        return idx, w, loc, counts, aux.reshape(()), z.reshape(())

    @staticmethod
    def backward(ctx, g_idx, g_w, g_loc, g_counts, g_aux, g_z):
        logits, bias, idx = ctx.saved_tensors
        config = ctx.config
        T, E = logits.shape
        fn = "epx.torch.route (backward)"
        dev = Device(config.device)
        g_w = _tensor(g_w, fn, "grad_topk_w", _torch.float32, tuple(idx.shape), dev, optional=True)
        grad_logits = _torch.empty((T, E), dtype=_torch.float32, device=logits.device)
        ga = float(g_aux) if g_aux is not None else 0.0
        gz = float(g_z) if g_z is not None else 0.0
        _epx._check(_lib_handle.epx_route_backward(ctypes.byref(config), T, _ptr(logits),
                                                   _ptr(bias), _ptr(idx), _ptr(g_w), ga, gz,
                                                   _ptr(grad_logits)))
        return grad_logits, None, None, None


def route(logits, config=None, *, bias=None, **fields):
    """Routes T tokens (epx_route) -> :class:`TorchRouteResult`, differentiable:
    backward runs epx_route_backward with the gradients of topk_w, aux_loss
    and z_loss. logits [T, E] float32 on the CPU, or on a GPU with a CUDA
    libepx (the config's device and stream are set from the tensor)."""
    fn = "epx.torch.route"
    config = _epx._route_config(config, tuple(logits.shape), fields)
    is_cuda = logits.device.type == "cuda"
    dev = Device.CUDA if is_cuda else Device.CPU
    stream = _torch.cuda.current_stream(logits.device).cuda_stream if is_cuda else None
    config = config.copy(device=dev, stream=stream)
    E = int(config.num_experts)
    logits_c = _tensor(logits, fn, "logits", _torch.float32, (None, E if E > 0 else None), dev)
    bias_c = _tensor(bias, fn, "bias", _torch.float32, (E,), dev, optional=True)
    if bias_c is not None:
        bias_c = bias_c.detach()
    info = {}
    idx, w, loc, counts, aux, z = _Route.apply(logits_c, bias_c, config, info)
    return TorchRouteResult(idx, w, loc, counts, aux, z, info["capacity"],
                            info["nonfinite_tokens"])


# ---------------------------------------------------------------------------
# Layout and handle metadata
# ---------------------------------------------------------------------------


def _routing_tensor(t, fn, name, dtype, shape, buffer_device, optional=False):
    """A routing tensor of any numeric dtype, as the dtype the library reads."""
    if t is None and optional:
        return None
    if not isinstance(t, _torch.Tensor):
        _tensor(t, fn, name, dtype, shape, buffer_device)
    _check_device(t, fn, name, buffer_device)
    return _tensor(t.detach().to(dtype), fn, name, dtype, shape, buffer_device)


def dispatch_layout(buffer, topk_idx, topk_w=None, locations=None, *,
                    weighting=Weighting.IN_COMBINE, recorder=None):
    """The layout of a dispatch (epx_dispatch_layout, collective) -> epx.Handle.

    topk_idx [T, K] (any integer dtype; int32 is used), topk_w [T, K] (None
    only with Weighting.NONE), locations [T, K] for the capacity layout, all
    on the buffer's device. The handle keeps topk_w (``handle.topk_w``): it is
    the autograd input through which combine (or dispatch, with IN_DISPATCH)
    returns the weights' gradient.
    """
    fn = "epx.torch.dispatch_layout"
    dev = buffer.device
    with buffer._together("layout"):
        idx = _routing_tensor(topk_idx, fn, "topk_idx", _torch.int32, (None, None), dev)
        T, K = idx.shape
        w = _routing_tensor(topk_w, fn, "topk_w", _torch.float32, (T, K), dev, optional=True)
        loc = _routing_tensor(locations, fn, "locations", _torch.int32, (T, K), dev, optional=True)
    _on_stream(buffer, topk_idx.device)
    handle = buffer._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, recorder)
    handle.topk_w = topk_w
    handle.device = topk_idx.device
    return handle


def _meta_device(handle):
    return getattr(handle, "device", None) or _torch.device(_device_kind(handle.buffer.device))


def expert_counts(handle):
    """(counts [E_local], offsets [E_local + 1]) int64 tensors on the buffer's device."""
    if handle.buffer.device == Device.CPU:
        return tuple(_torch.from_numpy(a) for a in handle.expert_counts())
    dev = _meta_device(handle)
    n = handle.buffer.experts_per_rank
    counts = _torch.empty((n,), dtype=_torch.int64, device=dev)
    offsets = _torch.empty((n + 1,), dtype=_torch.int64, device=dev)
    _on_stream(handle.buffer, dev)
    _epx._check(_lib_handle.epx_handle_expert_counts(handle._use(None, "epx.torch.expert_counts"),
                                                     _ptr(counts), _ptr(offsets)))
    return counts, offsets


def recv_routing(handle):
    """(recv_expert int32, recv_w float32) tensors: [N] per received row, or
    [N, K] in the rank-major layout."""
    if handle.buffer.device == Device.CPU:
        return tuple(_torch.from_numpy(a) for a in handle.recv_routing())
    dev = _meta_device(handle)
    n = handle.recv_rows
    shape = (n, handle.top_k) if handle.buffer.layout == _epx.Layout.RANK_MAJOR else (n,)
    expert = _torch.empty(shape, dtype=_torch.int32, device=dev)
    w = _torch.empty(shape, dtype=_torch.float32, device=dev)
    _on_stream(handle.buffer, dev)
    if n:
        _epx._check(_lib_handle.epx_handle_recv_routing(handle._use(None, "epx.torch.recv_routing"),
                                                        _ptr(expert), _ptr(w)))
    return expert, w


def recv_source(handle):
    """(src_rank [N], src_token [N]) int32 tensors (-1 for padding)."""
    if handle.buffer.device == Device.CPU:
        return tuple(_torch.from_numpy(a) for a in handle.recv_source())
    dev = _meta_device(handle)
    n = handle.recv_rows
    rank = _torch.empty((n,), dtype=_torch.int32, device=dev)
    token = _torch.empty((n,), dtype=_torch.int32, device=dev)
    _on_stream(handle.buffer, dev)
    if n:
        _epx._check(_lib_handle.epx_handle_recv_source(handle._use(None, "epx.torch.recv_source"),
                                                       _ptr(rank), _ptr(token)))
    return rank, token


# ---------------------------------------------------------------------------
# Dispatch and combine
# ---------------------------------------------------------------------------


def _payload(handle, t, fn, name, rows):
    b = handle.buffer
    return _tensor(t, fn, name, _buffer_dtype(b), (rows, b.hidden), b.device,
                   align=_epx.PAYLOAD_ALIGNMENT)


def _weights_grad(handle, where, needs):
    return handle.weighting == where and needs


class _Dispatch(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, handle):
        fn = "epx.torch.dispatch"
        b = handle.buffer
        with b._together("dispatch", handle):
            x = _payload(handle, x, fn, "x", handle.num_tokens)
        n = handle.recv_rows
        recv_x = _torch.empty((n, b.hidden), dtype=x.dtype, device=x.device)
        _on_stream(b, x.device)
        b._dispatch(handle, _ptr(x), _ptr(recv_x), n)
        ctx.handle = handle
        ctx.want_w = _weights_grad(handle, Weighting.IN_DISPATCH,
                                   topk_w is not None and ctx.needs_input_grad[1])
        ctx.save_for_backward(x if ctx.want_w else None)
        return recv_x

    @staticmethod
    def backward(ctx, grad_recv_x):
        fn = "epx.torch.dispatch (backward)"
        handle = ctx.handle
        b = handle.buffer
        (x,) = ctx.saved_tensors
        with b._together("dispatch_backward", handle):
            g = _payload(handle, grad_recv_x, fn, "grad_recv_x", handle.recv_rows)
        grad_x = _torch.empty((handle.num_tokens, b.hidden), dtype=g.dtype, device=g.device)
        grad_w = (_torch.empty((handle.num_tokens, handle.top_k), dtype=_torch.float32,
                               device=g.device) if ctx.want_w else None)
        _on_stream(b, g.device)
        b._dispatch_backward(handle, _ptr(g), _ptr(grad_x), _ptr(x) if ctx.want_w else None,
                             _ptr(grad_w))
        return grad_x, grad_w, None


class _Combine(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_w, handle):
        fn = "epx.torch.combine"
        b = handle.buffer
        with b._together("combine", handle):
            e = _payload(handle, expert_out, fn, "expert_out", handle.recv_rows)
        out = _torch.empty((handle.num_tokens, b.hidden), dtype=e.dtype, device=e.device)
        _on_stream(b, e.device)
        b._combine(handle, _ptr(e), _ptr(out))
        ctx.handle = handle
        ctx.want_w = _weights_grad(handle, Weighting.IN_COMBINE,
                                   topk_w is not None and ctx.needs_input_grad[1])
        ctx.save_for_backward(e if ctx.want_w else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        fn = "epx.torch.combine (backward)"
        handle = ctx.handle
        b = handle.buffer
        (e,) = ctx.saved_tensors
        with b._together("combine_backward", handle):
            g = _payload(handle, grad_out, fn, "grad_out", handle.num_tokens)
        grad_e = _torch.empty((handle.recv_rows, b.hidden), dtype=g.dtype, device=g.device)
        grad_w = (_torch.empty((handle.num_tokens, handle.top_k), dtype=_torch.float32,
                               device=g.device) if ctx.want_w else None)
        _on_stream(b, g.device)
        b._combine_backward(handle, _ptr(g), _ptr(e) if ctx.want_w else None, _ptr(grad_e),
                            _ptr(grad_w))
        return grad_e, grad_w, None


def _weights_input(handle, where):
    w = getattr(handle, "topk_w", None)
    return w if handle.weighting == where else None


def dispatch(handle, x):
    """x [T, H] -> recv_x [N, H] (epx_dispatch, collective; differentiable in
    x, and in the handle's topk_w with Weighting.IN_DISPATCH). The handle
    comes from :func:`dispatch_layout` (or epx.Buffer.dispatch_layout, whose
    weights then get no gradient)."""
    return _Dispatch.apply(x, _weights_input(handle, Weighting.IN_DISPATCH), handle)


def combine(handle, expert_out):
    """expert_out [N, H] -> out [T, H] = sum_k w[t,k] * expert_out(t,k)
    (epx_combine, collective; differentiable in expert_out, and in the
    handle's topk_w with Weighting.IN_COMBINE: grad_w reaches the router)."""
    return _Combine.apply(expert_out, _weights_input(handle, Weighting.IN_COMBINE), handle)
