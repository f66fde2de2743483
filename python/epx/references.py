"""The dense references of dispatch and combine (the tests' oracle): the
[E, capacity, H] slots of a routing, computed by the library's plain-C
code."""
import ctypes

import numpy as np

from ._lib import lib, Weighting
from .arrays import (_as_dtype, empty, _F32, _I32, numpy_dtype, PAYLOAD_ALIGNMENT,
                     _payload_dtypes, _ptr)
from .errors import _c_int, _check, _invalid


def _dense(fn, call, dtype, payload, payload_name, payload_shape, out_shape, topk_idx, topk_w,
           locations, num_experts, capacity, weighting):
    dtype = _as_dtype(dtype)
    num_experts = _c_int(num_experts, ctypes.c_int32, fn, "num_experts")
    capacity = _c_int(capacity, ctypes.c_int32, fn, "capacity")
    if num_experts < 1 or capacity < 0:
        _invalid("%s: num_experts is %d and capacity %d; pass num_experts >= 1 and capacity >= 0",
                 fn, num_experts, capacity)
    if not isinstance(topk_idx, np.ndarray) or topk_idx.ndim != 2:
        _ptr(topk_idx, fn, "topk_idx", _I32, (None, None))
    T, K = topk_idx.shape
    H = payload_shape[-1]
    pi = _ptr(topk_idx, fn, "topk_idx", _I32, (T, K))
    pw = _ptr(topk_w, fn, "topk_w", _F32, (T, K), optional=True)
    pl = _ptr(locations, fn, "locations", _I32, (T, K))
    shape = tuple(T if s == "T" else s for s in payload_shape)
    px = _ptr(payload, fn, payload_name, _payload_dtypes(dtype), shape, align=PAYLOAD_ALIGNMENT)
    out = empty(tuple(T if s == "T" else s for s in out_shape), numpy_dtype(dtype))
    _check(call(int(dtype), T, H, num_experts, capacity, K, pi, pw, pl, int(weighting),
           px, out.ctypes.data))
    return out


def reference_dense_dispatch(x, topk_idx, topk_w, locations, num_experts, capacity,
                             weighting=Weighting.IN_COMBINE, dtype=None):
    """The dense one-hot dispatch, the einsum `sec,sm->ecm`
    (epx_reference_dense_dispatch): x [T, H] -> [E, C, H], weighted by topk_w
    only with Weighting.IN_DISPATCH."""
    dtype = _as_dtype(x.dtype) if dtype is None else dtype
    H = np.shape(x)[-1]
    return _dense("epx.reference_dense_dispatch", lib.epx_reference_dense_dispatch, dtype, x, "x",
                  ("T", H), (num_experts, capacity, H), topk_idx, topk_w, locations, num_experts,
                  capacity, weighting)


def reference_dense_combine(expert_out, topk_idx, topk_w, locations,
                            weighting=Weighting.IN_COMBINE, dtype=None):
    """The dense one-hot combine, the einsum `sec,ecm->sm`
    (epx_reference_dense_combine): expert_out [E, C, H] -> [T, H], weighted by
    topk_w only with Weighting.IN_COMBINE."""
    dtype = _as_dtype(expert_out.dtype) if dtype is None else dtype
    if np.ndim(expert_out) != 3:
        _invalid("epx.reference_dense_combine: expert_out has shape %s; expected [E, C, H]",
                 list(np.shape(expert_out)))
    E, C, H = expert_out.shape
    return _dense("epx.reference_dense_combine", lib.epx_reference_dense_combine, dtype,
                  expert_out, "expert_out", (E, C, H), ("T", H), topk_idx, topk_w, locations, E, C,
                  weighting)
