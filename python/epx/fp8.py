"""The fp8 payload formats on the host: fp8_scale_shape (the C library's
answer, with the scale dtype from epx.semantics' format table), and
quantize / dequantize over numpy arrays (epx_quantize, epx_dequantize)."""
import ctypes

import numpy as np

from ._lib import DType, FP8Format, lib
from .arrays import _as_dtype, empty, numpy_dtype, _shape_text
from .semantics import fp8_scale_dtype
from .errors import _check, _invalid


def fp8_scale_shape(format, hidden):
    """(scale_cols, numpy dtype) of one row's scales in an fp8 format
    (epx_fp8_scale_shape): float32 per 128, int32 words of 4 UE8M0 bytes per
    512, uint8 E8M0 per 32."""
    cols, size = ctypes.c_int64(), ctypes.c_size_t()
    _check(lib.epx_fp8_scale_shape(int(FP8Format(format)), int(hidden), ctypes.byref(cols),
                                   ctypes.byref(size)))
    return int(cols.value), np.dtype(fp8_scale_dtype(format))


def _two_dims(fn, name, a):
    if a.ndim != 2:
        _invalid("%s: %s has shape %s; pass [rows, H]", fn, name, list(a.shape))


def quantize(x, format, dtype=None):
    """x [rows, H] (float32, bfloat16 as uint16 or named, float16) -> (x_q
    [rows, H] uint8 e4m3fn bytes, x_scales [rows, scale_cols]) with the
    format's quantizer, bit for bit the peers' formula (epx_quantize)."""
    src_dtype = _as_dtype(dtype if dtype is not None else x.dtype)
    x = np.ascontiguousarray(x)
    _two_dims("quantize", "x", x)
    rows, hidden = x.shape
    cols, sdt = fp8_scale_shape(format, hidden)
    q = np.empty((rows, hidden), np.uint8)
    scales = np.empty((rows, cols), sdt)
    _check(lib.epx_quantize(int(format), int(src_dtype), rows, hidden, x.ctypes.data,
                            q.ctypes.data, scales.ctypes.data))
    return q, scales


def dequantize(x_q, x_scales, format, dtype=DType.FLOAT32):
    """(x_q, x_scales) -> x [rows, H] of dtype (epx_dequantize)."""
    dtype = _as_dtype(dtype)
    x_q, x_scales = np.ascontiguousarray(x_q), np.ascontiguousarray(x_scales)
    _two_dims("dequantize", "x_q", x_q)
    rows, hidden = x_q.shape
    cols, sdt = fp8_scale_shape(format, hidden)
    if x_scales.shape != (rows, cols) or x_scales.dtype.itemsize != sdt.itemsize:
        _invalid("dequantize: x_scales is %s %s; pass [%d, %d] %s", x_scales.dtype,
                 _shape_text(x_scales.shape), rows, cols, sdt)
    out = empty((rows, hidden), numpy_dtype(dtype))
    _check(lib.epx_dequantize(int(format), int(dtype), rows, hidden, x_q.ctypes.data,
                              x_scales.ctypes.data, out.ctypes.data))
    return out
