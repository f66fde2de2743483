"""The custom ops of the exchange: epx::dispatch, epx::combine, the exact-size
and cached dispatches, and their backward passes (epx::dispatch_backward,
epx::weights_backward, epx::combine_backward), with fake functions and
autograd."""
from typing import Optional, Tuple

import torch as _torch
from torch import Tensor

import epx as _epx
from epx._lib import lib
from epx import semantics
from epx.errors import _check
from .autograd import _autograd
from .checkpointing import _recorder
from .handles import _handle_of, _token
from .profiling import _ranged
from .tensors import (_buffer, _check_handle_rows, _check_handle_shape, _empties, _F32, _host_copy,
                      _I32, _I64, _max_rows, _on_stream, _ptr, _recv_w_shape, _routing_tensor,
                      _sized_buffer, _tensor, _TORCH_OF)


def _dispatch_inputs(b, x, topk_idx, topk_w, locations, fn, x_dtype=None):
    dev = b.device
    _sized_buffer(b, fn)
    idx = _routing_tensor(topk_idx, fn, "topk_idx", _I32, (None, None), dev,
                          high=b.num_experts)
    T, K = idx.shape
    w = _routing_tensor(topk_w, fn, "topk_w", _F32, (T, K), dev, optional=True)
    loc = _routing_tensor(locations, fn, "locations", _I32, (T, K), dev, optional=True)
    x = _tensor(x, fn, "x", x_dtype or _TORCH_OF[b.dtype], (T, b.hidden), dev,
                align=_epx.PAYLOAD_ALIGNMENT)
    return x, idx, w, loc


def _expert_counts(b, handle, dev, fn):
    """(counts [E_local], offsets [E_local + 1]) of a dispatch's handle."""
    n = b.experts_per_rank
    counts = _torch.empty((n,), dtype=_I64, device=dev)
    offsets = _torch.empty((n + 1,), dtype=_I64, device=dev)
    _check(lib.epx_handle_expert_counts(handle._use(b, fn), _ptr(counts), _ptr(offsets)))
    return counts, offsets


def _recv_metadata(b, handle, rows, K, dev, fn, counts=None):
    """(recv_w, recv_expert, counts, offsets, N) of a dispatch's handle
    (counts: _expert_counts' pair, when already made)."""
    shape = _recv_w_shape(b, rows, K)
    recv_expert = _torch.full(shape, -1, dtype=_I32, device=dev)
    recv_w = _torch.zeros(shape, dtype=_F32, device=dev)
    counts, offsets = counts or _expert_counts(b, handle, dev, fn)
    _check(lib.epx_handle_recv_routing(handle._use(b, fn), _ptr(recv_expert), _ptr(recv_w)))
    # offsets[-1] is N in every layout: the row count, read on the device.
    return recv_w, recv_expert, counts, offsets, offsets[-1:].clone()


def _dispatch_layout(x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id, fn):
    """The layout step of a dispatch op: (buffer, x checked, top_k, handle,
    its token)."""
    b = _buffer(buffer_id, fn)
    with b._together("layout"):
        xc, idx, w, loc = _dispatch_inputs(b, x, topk_idx, topk_w, locations, fn)
        rec = _recorder(recorder_id, fn)
    T, K = idx.shape
    _on_stream(b, x.device)
    handle = b._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, rec)
    return b, xc, K, handle, _token(handle)


@_torch.library.custom_op("epx::dispatch", mutates_args=())
@_ranged("epx::dispatch")
def _dispatch_op(x: Tensor, topk_idx: Tensor, topk_w: Optional[Tensor],
                 locations: Optional[Tensor], buffer_id: int, weighting: int, recorder_id: int
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    fn = "epx.torch.dispatch"
    b, xc, K, handle, token = _dispatch_layout(x, topk_idx, topk_w, locations, buffer_id,
                                               weighting, recorder_id, fn)
    rows = _max_rows(b, fn)
    dev = x.device
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=dev)
    b._dispatch(handle, _ptr(xc), _ptr(recv_x), rows)
    return (recv_x,) + _recv_metadata(b, handle, rows, K, dev, fn) + (token,)


@_dispatch_op.register_fake
def _dispatch_fake(x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
    b = _buffer(buffer_id, "epx.torch.dispatch")
    _sized_buffer(b, "epx.torch.dispatch")
    rows = _max_rows(b, "epx.torch.dispatch")
    return _empties(semantics.dispatch_outputs(rows, b.hidden, topk_idx.shape[1],
                                               b.experts_per_rank, b.layout), x)


@_torch.library.custom_op("epx::dispatch_backward", mutates_args=())
@_ranged("epx::dispatch_backward")
def _dispatch_backward_op(grad_recv_x: Tensor, x: Optional[Tensor], token: Tensor,
                          num_tokens: int, top_k: int) -> Tuple[Tensor, Tensor]:
    """grad_recv_x -> (grad_x, grad_w); grad_w is computed (weights applied in
    dispatch) when x, the forward's input, is given, else zeros."""
    fn = "epx.torch.dispatch (backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    rows = grad_recv_x.shape[0]
    with b._together("dispatch_backward", h):
        _check_handle_shape(h, fn, num_tokens, top_k)
        g = _tensor(grad_recv_x, fn, "grad_recv_x", _TORCH_OF[b.dtype], (rows, b.hidden),
                    b.device, align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(g.shape[0], h, b, fn, "grad_recv_x")
        if x is not None:
            x = _tensor(x, fn, "x", g.dtype, (num_tokens, b.hidden), b.device,
                        align=_epx.PAYLOAD_ALIGNMENT)
    grad_x = _torch.empty((num_tokens, b.hidden), dtype=g.dtype, device=g.device)
    grad_w = _torch.zeros((num_tokens, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    b._dispatch_backward(h, _ptr(g), _ptr(grad_x), _ptr(x), _ptr(grad_w) if x is not None
                         else None)
    return grad_x, grad_w


@_dispatch_backward_op.register_fake
def _dispatch_backward_fake(grad_recv_x, x, token, num_tokens, top_k):
    return _empties(semantics.dispatch_backward_outputs(num_tokens, grad_recv_x.shape[1], top_k),
                    grad_recv_x)


@_torch.library.custom_op("epx::weights_backward", mutates_args=())
@_ranged("epx::weights_backward")
def _weights_backward_op(grad_recv_w: Tensor, token: Tensor, num_tokens: int,
                         top_k: int) -> Tensor:
    """The gradient of recv_w (weights the expert applied) -> grad_w [T, K]."""
    fn = "epx.torch.dispatch (weights backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("weights_backward", h):
        _check_handle_shape(h, fn, num_tokens, top_k)
        rows = grad_recv_w.shape[0] if grad_recv_w.dim() else 0
        g = _tensor(grad_recv_w, fn, "grad_recv_w", _F32, _recv_w_shape(b, rows, top_k),
                    b.device)
        _check_handle_rows(g.shape[0], h, b, fn, "grad_recv_w")
    grad_w = _torch.empty((num_tokens, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    _check(lib.epx_weights_backward(b._handle_ptr(fn), h._use(b, fn), _ptr(g),
                                         _ptr(grad_w)))
    return grad_w


@_weights_backward_op.register_fake
def _weights_backward_fake(grad_recv_w, token, num_tokens, top_k):
    return _empties(semantics.weights_backward_outputs(num_tokens, top_k), grad_recv_w)[0]


def _dispatch_grads(ctx, s, pair, g_recv_x, g_recv_w, *unused):
    """recv_x's gradient through dispatch_backward (with the weights' part
    where they were applied in dispatch), recv_w's through weights_backward."""
    dispatch_backward, weights_backward = pair
    grad_x = grad_w = None
    if g_recv_x is not None:
        grad_x, gw = dispatch_backward(g_recv_x.contiguous(), s.x, s.handle, s.num_tokens,
                                       s.top_k)
        grad_w = gw if ctx.w_in_dispatch else None
    if g_recv_w is not None and ctx.w_grad:
        gw = weights_backward(g_recv_w.contiguous(), s.handle, s.num_tokens, s.top_k)
        grad_w = gw if grad_w is None else grad_w + gw
    return {"x": grad_x, "topk_w": grad_w}


_autograd(_dispatch_op, _dispatch_grads)


@_torch.library.custom_op("epx::combine", mutates_args=())
@_ranged("epx::combine")
def _combine_op(expert_out: Tensor, topk_w: Optional[Tensor], token: Tensor, num_tokens: int,
                weighting: int) -> Tensor:
    """expert_out [rows >= N, H] -> out [T, H]. topk_w is only the autograd
    input through which combine's backward returns the weights' gradient
    (the handle has its own copy of the weights)."""
    fn = "epx.torch.combine"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("combine", h):
        _check_handle_shape(h, fn, num_tokens)
        rows = expert_out.shape[0] if isinstance(expert_out, Tensor) and expert_out.dim() else 0
        e = _tensor(expert_out, fn, "expert_out", _TORCH_OF[b.dtype], (rows, b.hidden),
                    b.device, align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(e.shape[0], h, b, fn, "expert_out")
    out = _torch.empty((num_tokens, b.hidden), dtype=e.dtype, device=e.device)
    _on_stream(b, e.device)
    b._combine(h, _ptr(e), _ptr(out))
    return out


@_combine_op.register_fake
def _combine_fake(expert_out, topk_w, token, num_tokens, weighting):
    return _empties(semantics.combine_outputs(num_tokens, expert_out.shape[1]), expert_out)[0]


@_torch.library.custom_op("epx::combine_backward", mutates_args=())
@_ranged("epx::combine_backward")
def _combine_backward_op(grad_out: Tensor, expert_out: Optional[Tensor], token: Tensor,
                         rows: int, top_k: int) -> Tuple[Tensor, Tensor]:
    """grad_out -> (grad_expert_out [rows, H], zeros past the valid rows;
    grad_w [T, K], computed when expert_out, the forward's input, is given)."""
    fn = "epx.torch.combine (backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    T = grad_out.shape[0]
    with b._together("combine_backward", h):
        _check_handle_shape(h, fn, T)
        g = _tensor(grad_out, fn, "grad_out", _TORCH_OF[b.dtype], (T, b.hidden), b.device,
                    align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(rows, h, b, fn, "grad_expert_out")
        if expert_out is not None:
            expert_out = _tensor(expert_out, fn, "expert_out", g.dtype, (rows, b.hidden),
                                 b.device, align=_epx.PAYLOAD_ALIGNMENT)
    grad_e = _torch.zeros((rows, b.hidden), dtype=g.dtype, device=g.device)
    grad_w = _torch.zeros((T, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    b._combine_backward(h, _ptr(g), _ptr(expert_out), _ptr(grad_e),
                        _ptr(grad_w) if expert_out is not None else None)
    return grad_e, grad_w


@_combine_backward_op.register_fake
def _combine_backward_fake(grad_out, expert_out, token, rows, top_k):
    return _empties(semantics.combine_backward_outputs(rows, grad_out.shape[1],
                                                       grad_out.shape[0], top_k), grad_out)


def _combine_grads(ctx, s, pair, grad_out):
    """out's gradient through combine_backward: expert_out's, and topk_w's
    where the weights were applied in combine."""
    combine_backward, = pair
    if grad_out is None:
        return {}
    grad_e, grad_w = combine_backward(grad_out.contiguous(), s.expert_out, s.token, s.rows,
                                      s.top_k)
    return {"expert_out": grad_e, "topk_w": grad_w if ctx.w_in_combine else None}


_autograd(_combine_op, _combine_grads)


# ---------------------------------------------------------------------------
# Exact-size dispatch (epx::dispatch_exact) and dispatch again on a handle
# (epx::dispatch_cached)
# ---------------------------------------------------------------------------


@_torch.library.custom_op("epx::dispatch_exact", mutates_args=())
@_ranged("epx::dispatch_exact")
def _dispatch_exact_op(x: Tensor, topk_idx: Tensor, topk_w: Optional[Tensor],
                       locations: Optional[Tensor], buffer_id: int, weighting: int,
                       recorder_id: int
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """epx::dispatch with receive tensors of exactly N rows: the layout's row
    count is read on the host (one host sync on CUDA) before they are made."""
    fn = "epx.torch.dispatch"
    b, xc, K, handle, token = _dispatch_layout(x, topk_idx, topk_w, locations, buffer_id,
                                               weighting, recorder_id, fn)
    # The counts are copied to the host before the row count's wait, which
    # then covers them too: Dispatched.counts_host() waits for nothing more.
    counts = _expert_counts(b, handle, x.device, fn)
    handle._counts_host = _host_copy(counts[0])
    rows = handle.recv_rows
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=x.device)
    b._dispatch(handle, _ptr(xc), _ptr(recv_x), rows)
    return (recv_x,) + _recv_metadata(b, handle, rows, K, x.device, fn, counts) + (token,)


@_dispatch_exact_op.register_fake
def _dispatch_exact_fake(x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
    b = _buffer(buffer_id, "epx.torch.dispatch")
    rows = _torch.library.get_ctx().new_dynamic_size()
    return _empties(semantics.dispatch_outputs(rows, b.hidden, topk_idx.shape[1],
                                               b.experts_per_rank, b.layout), x)


_autograd(_dispatch_exact_op, _dispatch_grads)


@_torch.library.custom_op("epx::dispatch_cached", mutates_args=())
@_ranged("epx::dispatch_cached")
def _dispatch_cached_op(x: Tensor, token: Tensor, rows: int, top_k: int) -> Tensor:
    """x [T, H] -> recv_x [rows, H] along an earlier dispatch's layout
    (epx_dispatch on its handle: no layout, no count exchange)."""
    fn = "epx.torch.dispatch (on a handle)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("dispatch", h):
        _check_handle_shape(h, fn, h.num_tokens, top_k)
        xc = _tensor(x, fn, "x", _TORCH_OF[b.dtype], (h.num_tokens, b.hidden), b.device,
                     align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(rows, h, b, fn, "recv_x")
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=x.device)
    _on_stream(b, x.device)
    b._dispatch(h, _ptr(xc), _ptr(recv_x), rows)
    return recv_x


@_dispatch_cached_op.register_fake
def _dispatch_cached_fake(x, token, rows, top_k):
    return x.new_empty((rows, x.shape[1]))


def _dispatch_cached_grads(ctx, s, pair, g_recv_x):
    """recv_x's gradient through dispatch_backward (no weights' part)."""
    dispatch_backward, = pair
    grad_x, _ = dispatch_backward(g_recv_x.contiguous(), None, s.token, s.num_tokens, s.top_k)
    return {"x": grad_x}


_autograd(_dispatch_cached_op, _dispatch_cached_grads)
