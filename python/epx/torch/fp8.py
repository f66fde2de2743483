"""fp8 dispatch as custom ops (epx::dispatch_fp8, epx::dispatch_fp8_cached),
dequantize on the device, and the straight-through autograd of
quantize-on-dispatch."""
from typing import Optional, Tuple

import torch as _torch
from torch import Tensor

import epx as _epx
from epx import semantics
from epx.errors import _invalid
from .autograd import _autograd, _input_names, _keep, _kept, _pair
from .checkpointing import _recorder
from .handles import _handle_of, _token
from .ops import _dispatch_inputs, _recv_metadata
from .profiling import _ranged
from .tensors import (_buffer, _check_handle_rows, _check_handle_shape, _empties, _F32, _I32,
                      _max_rows, _OF_NAME, _on_stream, _ptr, _sized_buffer, _tensor, _TORCH_OF)


_FP8 = _OF_NAME[semantics.FP8]


def _scale_dtype(fmt):
    return _OF_NAME[semantics.fp8_scale_dtype(fmt)]


def _fp8_format(b, fn):
    fmt = _epx.FP8Format(b.config.fp8_format)
    if fmt == _epx.FP8Format.NONE or _FP8 is None:
        _invalid("%s: the buffer has no fp8 format (config.fp8_format is NONE)%s; create it "
                 "with fp8_format=epx.FP8Format...", fn,
                 "" if _FP8 is not None else " or this torch has no float8_e4m3fn")
    cols, _ = _epx.fp8_scale_shape(fmt, b.hidden)
    return fmt, cols


def _fp8_recv(b, fmt, cols, rows, make):
    """An fp8 dispatch's outputs, recv_x_q [rows, H] and recv_scales [rows,
    cols] in the format's scale dtype, made by make(shape, dtype): zeros on
    the device, or a fake op's new_empty."""
    q, s = semantics.dispatch_fp8_payload(rows, b.hidden, fmt, cols)
    return make(q.shape, _FP8), make(s.shape, _scale_dtype(fmt))


@_torch.library.custom_op("epx::dispatch_fp8", mutates_args=())
@_ranged("epx::dispatch_fp8")
def _dispatch_fp8_op(x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor,
                     topk_w: Optional[Tensor], locations: Optional[Tensor], buffer_id: int,
                     weighting: int, recorder_id: int
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x_q with x_scales (epx_dispatch_fp8), or x of the buffer's dtype
    quantized on the way when x_scales is None (epx_dispatch_quantize)."""
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    with b._together("layout"):
        fmt, cols = _fp8_format(b, fn)
        quantize = x_scales is None
        xc, idx, w, loc = _dispatch_inputs(b, x if quantize else x.view(_torch.uint8), topk_idx,
                                           topk_w, locations, fn, _TORCH_OF[b.dtype] if quantize
                                           else _torch.uint8)
        T, K = idx.shape
        sc = None if quantize else _tensor(x_scales, fn, "x_scales", _scale_dtype(fmt), (T, cols),
                                           b.device)
        rec = _recorder(recorder_id, fn)
    _on_stream(b, x.device)
    handle = b._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, rec)
    token = _token(handle)
    rows = _max_rows(b, fn)
    recv_q, recv_s = _fp8_recv(b, fmt, cols, rows,
                               lambda dims, dtype: _torch.zeros(dims, dtype=dtype, device=x.device))
    b._dispatch_fp8(handle, _ptr(xc), _ptr(sc), _ptr(recv_q), _ptr(recv_s), rows)
    return (recv_q, recv_s) + _recv_metadata(b, handle, rows, K, x.device, fn) + (token,)


@_dispatch_fp8_op.register_fake
def _dispatch_fp8_fake(x, x_scales, topk_idx, topk_w, locations, buffer_id, weighting,
                       recorder_id):
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    _sized_buffer(b, fn)
    fmt, cols = _fp8_format(b, fn)
    rows = _max_rows(b, fn)
    return _empties(semantics.dispatch_fp8_outputs(rows, b.hidden, topk_idx.shape[1],
                                                   b.experts_per_rank, b.layout, fmt, cols), x)


def _dispatch_fp8_grads(ctx, s, pair, g_q, g_s, g_recv_w, *unused):
    """fp8 rows carry no gradient; recv_w's goes to topk_w as in dispatch."""
    weights_backward, = pair
    grad_w = None
    if g_recv_w is not None and ctx.w_grad:
        grad_w = weights_backward(g_recv_w.contiguous(), s.handle, s.num_tokens, s.top_k)
    return {"topk_w": grad_w}


_autograd(_dispatch_fp8_op, _dispatch_fp8_grads)


def dequantize(recv_x, recv_scales, fp8_format, dtype=_torch.bfloat16):
    """fp8 rows [N, H] (float8_e4m3fn) and their scales -> [N, H] of dtype:
    float32(e4m3) * scale rounded once, the bits of epx_dequantize and of
    DeepEP's per_token_cast_back (a UE8M0 byte is its exponent: 255 is
    infinite; an MXFP8 E8M0 byte 255 is NaN, 0 is 2^-127)."""
    fmt = _epx.FP8Format(fp8_format)
    n, h = recv_x.shape
    if fmt == _epx.FP8Format.E4M3_F32_128:
        scale = recv_scales.float()
    else:
        exponent = recv_scales.contiguous().view(_torch.uint8).view(n, -1).to(_I32)
        scale = semantics.fp8_scale_bits(fmt, exponent, _torch.where).view(_F32)
    block = h // scale.shape[1]
    return (recv_x.float().view(n, -1, block) * scale.unsqueeze(2)).view(n, h).to(dtype)


_ST_OP = "dispatch_fp8"  # the op _Fp8StraightThrough runs (semantics.STRAIGHT_THROUGH)
_ST_ARGS = _input_names(_dispatch_fp8_op)


class _Fp8StraightThrough(_torch.autograd.Function):
    """Quantize-on-dispatch whose experts see the dequantized rows: it keeps
    what dispatch_fp8 keeps, and its gradients are those of a dispatch of
    those rows (straight through the quantizer: the rows' gradient by
    epx_dispatch_backward, in the buffer's dtype; recv_w's to topk_w), as
    epx.semantics says."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
        inputs = (x, None, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id)
        outs = _torch.ops.epx.dispatch_fp8(*inputs)
        _keep(ctx, _ST_OP, _ST_ARGS, inputs, outs)
        recv_q, recv_s, recv_w, recv_expert, counts, offsets, rows, token = outs
        fmt = _buffer(buffer_id, "epx.torch.MoE").config.fp8_format
        ctx.mark_non_differentiable(recv_expert, counts, offsets, rows, token)
        return (dequantize(recv_q, recv_s, fmt, x.dtype), recv_w, recv_expert, counts, offsets, rows,
                token)

    @staticmethod
    def backward(ctx, g_recv_x, g_recv_w, *unused):
        s = _kept(ctx, _ST_OP)
        dispatch_backward, weights_backward = _pair(semantics.STRAIGHT_THROUGH[_ST_OP])
        grad_x = grad_w = None
        if g_recv_x is not None:
            grad_x, _ = dispatch_backward(g_recv_x.contiguous(), None, s.handle, s.num_tokens,
                                          s.top_k)
        if g_recv_w is not None and ctx.w_grad:
            grad_w = weights_backward(g_recv_w.contiguous(), s.handle, s.num_tokens, s.top_k)
        return grad_x, None, grad_w, None, None, None, None



@_torch.library.custom_op("epx::dispatch_fp8_cached", mutates_args=())
@_ranged("epx::dispatch_fp8_cached")
def _dispatch_fp8_cached_op(x: Tensor, x_scales: Optional[Tensor], token: Tensor, rows: int,
                            top_k: int, buffer_id: int) -> Tuple[Tensor, Tensor]:
    """x_q with x_scales (epx_dispatch_fp8), or x of the buffer's dtype
    quantized on the way when x_scales is None (epx_dispatch_quantize),
    along an earlier dispatch's layout: (recv_x_q [rows, H], recv_scales
    [rows, scale_cols])."""
    fn = "epx.torch.dispatch (on a handle)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("dispatch", h):
        _check_handle_shape(h, fn, h.num_tokens, top_k)
        fmt, cols = _fp8_format(b, fn)
        quantize = x_scales is None
        xc = _tensor(x if quantize else x.view(_torch.uint8), fn, "x",
                     _TORCH_OF[b.dtype] if quantize else _torch.uint8, (h.num_tokens, b.hidden),
                     b.device, align=_epx.PAYLOAD_ALIGNMENT)
        sc = None if quantize else _tensor(x_scales, fn, "x_scales", _scale_dtype(fmt),
                                           (h.num_tokens, cols), b.device)
        _check_handle_rows(rows, h, b, fn, "recv_x")
    recv_q, recv_s = _fp8_recv(b, fmt, cols, rows,
                               lambda dims, dtype: _torch.zeros(dims, dtype=dtype, device=x.device))
    _on_stream(b, x.device)
    b._dispatch_fp8(h, _ptr(xc), _ptr(sc), _ptr(recv_q), _ptr(recv_s), rows)
    return recv_q, recv_s


@_dispatch_fp8_cached_op.register_fake
def _dispatch_fp8_cached_fake(x, x_scales, token, rows, top_k, buffer_id):
    b = _buffer(buffer_id, "epx.torch.dispatch (on a handle)")
    fmt, cols = _fp8_format(b, "epx.torch.dispatch (on a handle)")
    return _fp8_recv(b, fmt, cols, rows, lambda dims, dtype: x.new_empty(dims, dtype=dtype))


# fp8 rows carry no gradient (as a fresh fp8 dispatch's): no rule.
_autograd(_dispatch_fp8_cached_op)
