"""epx — expert-parallel exchange for Mixture-of-Experts layers, from Python.

A ctypes binding of libepx (include/epx.h is the contract). It mirrors the C
API call for call:

- every status other than EPX_SUCCESS raises :class:`EpxError`, carrying the
  status and the library's message (``epx_last_error()``);
- the config structs are ctypes Structures whose defaults are the C
  ``*_INIT`` macros' (:class:`RouteConfig`, :class:`BufferConfig`,
  :class:`CommConfig`);
- the objects (:class:`Comm`, :class:`LocalWorld`, :class:`Buffer`,
  :class:`Handle`, :class:`Recorder`) have ``close()`` and are context
  managers; closing a parent closes its children first (handles before
  buffers before comms), and garbage collection releases what was not closed;
- arrays are numpy arrays, C-contiguous, of the exact dtype, payloads 16-byte
  aligned (:func:`empty` allocates them so). bfloat16 has no numpy dtype: it
  travels as uint16 (:func:`to_bf16` / :func:`from_bf16` convert).

ctypes releases the GIL during every library call, so ranks of the local
transport run as Python threads (:func:`run_local`). On CUDA buffers every
tensor lives on the device: use :mod:`epx.torch` there.

The shortest layer step, on one rank::

    import numpy as np, epx
    logits = np.random.randn(64, 8).astype(np.float32)
    x = epx.empty((64, 32), np.float32); x[:] = np.random.randn(64, 32)
    r = epx.route(logits, top_k=2)
    with epx.Comm.create_self() as comm, comm.buffer(hidden=32, num_experts=8, max_top_k=2) as buf:
        h = buf.dispatch_layout(r)
        recv_x = buf.dispatch(h, x)
        out = buf.combine(h, recv_x * 2)          # an expert that doubles
"""
import contextlib
import ctypes
import itertools
import math
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _lib
from ._lib import (AuxCounts, BufferConfig, CapacityArithmetic, CombinePrecision, CommConfig,
                   DType, Device, DropPolicy, Exchange, ExchangePath, FP8Format, Layout, Nonfinite,
                   QueueOrder, RecorderMode, RouteConfig, ScoreFn, Status, Weighting)

lib = _lib.lib
library_path = _lib.path

__version__ = "%d.%d.%d" % _lib.VERSION
CONFIG_VERSION = _lib.CONFIG_VERSION
PAYLOAD_ALIGNMENT = 16

__all__ = [
    "EpxError", "InvalidArgumentError", "OutOfMemoryError", "UnsupportedError",
    "CapacityExceededError", "ShapeMismatchError", "InvalidHandleError", "BusyError",
    "TimeoutError", "PeerFailedError", "TransportError", "ReplayMismatchError", "CudaError",
    "InternalError", "Status", "DType", "Device", "ScoreFn", "QueueOrder", "DropPolicy",
    "Nonfinite", "CapacityArithmetic", "AuxCounts", "CombinePrecision", "ExchangePath",
    "Exchange", "Layout", "Weighting", "RecorderMode", "RouteConfig", "BufferConfig",
    "CommConfig", "RouteResult", "HandleStats", "RecorderStats", "Comm", "LocalWorld",
    "Buffer", "Handle", "Recorder", "route", "route_backward", "run_local", "empty", "zeros",
    "asarray", "convert", "to_bf16", "from_bf16", "dtype_size", "has_cuda", "has_mpi", "has_nccl",
    "reference_dense_dispatch", "reference_dense_combine", "numpy_dtype", "library_version",
    "reference_route", "reference_route_backward", "route_agree_capacity", "route_capacity", "route_sum_counts",
    "FP8Format", "fp8_scale_shape", "quantize", "dequantize",
]

# The C enumerators under their C names (epx.EPX_BFLOAT16, epx.EPX_WEIGHTS_IN_COMBINE, ...).
for _enum, _prefix in ((Status, "EPX_"), (DType, "EPX_"), (Device, "EPX_DEVICE_"),
                       (ScoreFn, "EPX_SCORE_"), (QueueOrder, "EPX_QUEUE_"),
                       (DropPolicy, "EPX_DROP_"), (Nonfinite, "EPX_NONFINITE_"),
                       (CapacityArithmetic, "EPX_CAPACITY_"), (AuxCounts, "EPX_AUX_COUNTS_"),
                       (CombinePrecision, "EPX_COMBINE_"), (ExchangePath, "EPX_PATH_"),
                       (Exchange, "EPX_EXCHANGE_"), (Layout, "EPX_LAYOUT_"),
                       (Weighting, "EPX_WEIGHTS_"), (RecorderMode, "EPX_RECORDER_"),
                       (FP8Format, "EPX_FP8_")):
    for _member in _enum:
        globals()[_prefix + _member.name] = _member
        __all__.append(_prefix + _member.name)
del _enum, _prefix, _member

# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class EpxError(RuntimeError):
    """A call that did not return EPX_SUCCESS.

    ``status`` is the :class:`Status`, ``status_name`` its C name
    ("EPX_ERROR_TIMEOUT") and ``message`` the library's epx_last_error() (or,
    for a check made in Python before the call, a message in the same form:
    the function, the argument, the fix; ``in_library`` tells which). Nothing
    the caller owns was changed.

    Each status raises its own subclass (:class:`InvalidArgumentError`,
    :class:`TimeoutError`, ...), which also derives from the built-in
    exception that fits (ValueError, MemoryError, TimeoutError, ...), so
    ``except ValueError`` catches a bad argument. ``EpxError(status, msg)``
    itself builds the subclass of that status.
    """

    def __new__(cls, status=Status.ERROR_INTERNAL, message="", in_library=False):
        if cls is EpxError:
            cls = _ERROR_CLASSES.get(int(status), EpxError)
        # The __new__ of the built-in whose memory layout the class has
        # (OSError's for TimeoutError and ConnectionError).
        solid = max((b for b in cls.__mro__ if b.__module__ == "builtins"),
                    key=lambda b: b.__basicsize__)
        return solid.__new__(cls)

    def __init__(self, status, message, in_library=False):
        self.in_library = in_library  # False: refused by a check made in Python
        try:
            self.status = Status(status)
            self.status_name = "EPX_" + self.status.name
        except ValueError:
            self.status = int(status)
            self.status_name = lib.epx_status_string(int(status)).decode()
        self.message = message
        RuntimeError.__init__(self, "%s: %s" % (self.status_name, message))

    def __str__(self):
        return "%s: %s" % (self.status_name, self.message)

    def __reduce__(self):
        return (EpxError, (int(self.status), self.message, self.in_library))


_ERROR_CLASSES = {}


def _error_class(name, status, builtin, doc):
    """The EpxError subclass of one status (also a `builtin` when not None)."""
    bases = (EpxError,) if builtin is None else (EpxError, builtin)
    cls = type(name, bases, {"__doc__": doc, "__module__": __name__, "__new__": EpxError.__new__})
    _ERROR_CLASSES[int(status)] = cls
    return cls


InvalidArgumentError = _error_class("InvalidArgumentError", Status.ERROR_INVALID_ARGUMENT,
                                    ValueError, "EPX_ERROR_INVALID_ARGUMENT (a ValueError).")
OutOfMemoryError = _error_class("OutOfMemoryError", Status.ERROR_OUT_OF_MEMORY, MemoryError,
                                "EPX_ERROR_OUT_OF_MEMORY (a MemoryError).")
UnsupportedError = _error_class("UnsupportedError", Status.ERROR_UNSUPPORTED, NotImplementedError,
                                "EPX_ERROR_UNSUPPORTED (a NotImplementedError): this build or "
                                "this device cannot do it.")
CapacityExceededError = _error_class("CapacityExceededError", Status.ERROR_CAPACITY_EXCEEDED,
                                     ValueError, "EPX_ERROR_CAPACITY_EXCEEDED (a ValueError): "
                                     "more tokens or rows than the buffer holds.")
ShapeMismatchError = _error_class("ShapeMismatchError", Status.ERROR_SHAPE_MISMATCH, ValueError,
                                  "EPX_ERROR_SHAPE_MISMATCH (a ValueError): ranks disagree.")
InvalidHandleError = _error_class("InvalidHandleError", Status.ERROR_INVALID_HANDLE, ValueError,
                                  "EPX_ERROR_INVALID_HANDLE (a ValueError): a released or "
                                  "foreign object.")
BusyError = _error_class("BusyError", Status.ERROR_BUSY, None,
                         "EPX_ERROR_BUSY: the object is still in use (handles alive).")
TimeoutError = _error_class("TimeoutError", Status.ERROR_TIMEOUT, TimeoutError,  # noqa: A001
                            "EPX_ERROR_TIMEOUT (also the built-in TimeoutError): a peer did not "
                            "answer in time.")
PeerFailedError = _error_class("PeerFailedError", Status.ERROR_PEER_FAILED, ConnectionError,
                               "EPX_ERROR_PEER_FAILED (a ConnectionError): another rank failed.")
TransportError = _error_class("TransportError", Status.ERROR_TRANSPORT, ConnectionError,
                              "EPX_ERROR_TRANSPORT (a ConnectionError): MPI or NCCL failed.")
ReplayMismatchError = _error_class("ReplayMismatchError", Status.ERROR_REPLAY_MISMATCH,
                                   ValueError, "EPX_ERROR_REPLAY_MISMATCH (a ValueError): a "
                                   "recompute routed differently from its record.")
CudaError = _error_class("CudaError", Status.ERROR_CUDA, None, "EPX_ERROR_CUDA.")
InternalError = _error_class("InternalError", Status.ERROR_INTERNAL, None, "EPX_ERROR_INTERNAL.")


def _check(status):
    if status != 0:
        # The message first: it is valid until this thread's next epx call.
        message = lib.epx_last_error().decode("utf-8", "replace")
        raise EpxError(status, message, in_library=True)


def _refuse(status, fmt, *args):
    raise EpxError(status, fmt % args if args else fmt)


def _invalid(fmt, *args):
    _refuse(Status.ERROR_INVALID_ARGUMENT, fmt, *args)


_lib.refuse_invalid = _invalid  # config fields out of their C range: an InvalidArgumentError


def _c_int(value, ctype, fn, name):
    """value as the int a C parameter of ctype (ctypes.c_int32, c_int64)
    gets, refused by name when outside its range (ctypes would wrap it:
    2**32 + 1 ranks are 1)."""
    _lib.check_int_range(value, ctype, "%s: %s" % (fn, name))
    return int(value)


# ---------------------------------------------------------------------------
# Numbers and arrays
# ---------------------------------------------------------------------------

_NP_OF_DTYPE = {DType.FLOAT32: np.dtype(np.float32), DType.BFLOAT16: np.dtype(np.uint16),
                DType.FLOAT16: np.dtype(np.float16)}
_DTYPE_NAMES = {"float32": DType.FLOAT32, "f32": DType.FLOAT32, "bfloat16": DType.BFLOAT16,
                "bf16": DType.BFLOAT16, "float16": DType.FLOAT16, "f16": DType.FLOAT16,
                "half": DType.FLOAT16}


def _as_dtype(dtype):
    """An epx DType from a DType, its int, a name ("bf16"), a torch dtype or a
    numpy dtype (uint16 is the carrier of bfloat16)."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        return DType(int(dtype))
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if type(dtype).__module__ == "torch":  # a torch.dtype ("torch.bfloat16"); torch not imported
        name = str(dtype).rsplit(".", 1)[-1]
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        raise TypeError("epx: %s is not an epx dtype; use torch.float32, torch.bfloat16 or "
                        "torch.float16" % (dtype,))
    nd = np.dtype(dtype)
    if nd.name == "bfloat16":
        return DType.BFLOAT16
    for d, n in _NP_OF_DTYPE.items():
        if n == nd:
            return d
    raise TypeError("epx: %r is not an epx dtype; use epx.DType.FLOAT32, BFLOAT16 or FLOAT16 "
                    "(numpy float32, uint16 for bfloat16, float16)" % (dtype,))


def numpy_dtype(dtype):
    """The numpy dtype that carries an epx dtype (bfloat16 -> uint16)."""
    return _NP_OF_DTYPE[_as_dtype(dtype)]


def _np_dtype(dtype):
    if isinstance(dtype, (DType, str)) or (isinstance(dtype, (int, np.integer))
                                           and not isinstance(dtype, bool)):
        return numpy_dtype(dtype)
    return np.dtype(dtype)


def dtype_size(dtype):
    """Bytes of one element (epx_dtype_size)."""
    return int(lib.epx_dtype_size(int(_as_dtype(dtype))))


def has_cuda():
    """Whether this libepx has the CUDA backend."""
    return bool(lib.epx_has_cuda())


def has_mpi():
    """Whether this libepx has the MPI transport."""
    return bool(lib.epx_has_mpi())


def has_nccl():
    """Whether this libepx has the NCCL transport (CUDA builds with NCCL)."""
    return bool(lib.epx_has_nccl())


def library_version():
    """The loaded libepx's version (epx_version) as (major, minor, patch);
    the binding was written for epx.VERSION."""
    code = int(lib.epx_version())
    return (code // 10000, code // 100 % 100, code % 100)


VERSION = _lib.VERSION


def empty(shape, dtype=np.float32, alignment=64):
    """An uninitialised C-contiguous array whose data is `alignment`-byte
    aligned (payloads need 16). dtype may be a numpy dtype or an epx DType
    (BFLOAT16 gives uint16)."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError("epx.empty: alignment %r is not a power of two" % (alignment,))
    nd = _np_dtype(dtype)
    shape = tuple(int(s) for s in shape) if hasattr(shape, "__len__") else (int(shape),)
    if any(s < 0 for s in shape):
        raise ValueError("epx.empty: shape %r has a negative dimension" % (shape,))
    nbytes = math.prod(shape) * nd.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    # [start:] first: numpy keeps the base address for an empty [a:b] slice.
    return raw[start:][:nbytes].view(nd).reshape(shape)


def zeros(shape, dtype=np.float32, alignment=64):
    """Like :func:`empty`, filled with zeros."""
    a = empty(shape, dtype, alignment)
    a.fill(0)
    return a


def asarray(a, dtype=None, alignment=PAYLOAD_ALIGNMENT):
    """`a` itself when it is already a C-contiguous, aligned array of dtype,
    else an aligned copy (dtype may be an epx DType)."""
    nd = _np_dtype(dtype) if dtype is not None else None
    if (isinstance(a, np.ndarray) and (nd is None or a.dtype == nd) and a.flags.c_contiguous
            and a.ctypes.data % alignment == 0):
        return a
    src = np.asarray(a, dtype=nd)
    out = empty(src.shape, src.dtype, max(alignment, 64))
    out[...] = src
    return out


def _shape_text(shape):
    return "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"


def _ptr(a, fn, name, dtypes, shape, align=4, writable=False, optional=False):
    """Checks an argument array and returns its address (None for an absent
    optional one). shape entries of None match any size."""
    if a is None:
        if optional:
            return None
        _invalid("%s: %s is None; pass a %s array of shape %s", fn, name,
                 dtypes[0].name, _shape_text(shape))
    if not isinstance(a, np.ndarray):
        _invalid("%s: %s is a %s; pass a numpy array (%s, shape %s)", fn, name,
                 type(a).__name__, dtypes[0].name, _shape_text(shape))
    if a.dtype not in dtypes:
        _invalid("%s: %s has dtype %s; pass %s (convert with .astype(np.%s) or epx.asarray)",
                 fn, name, a.dtype, " or ".join(d.name for d in dtypes), dtypes[0].name)
    if a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape)):
        _invalid("%s: %s has shape %s; expected %s", fn, name, list(a.shape), _shape_text(shape))
    flags = a.flags
    if not flags.c_contiguous:
        _invalid("%s: %s is not C-contiguous; pass np.ascontiguousarray(%s) or an epx.empty array",
                 fn, name, name)
    address = a.ctypes.data
    if address % align:
        _invalid("%s: %s is not %d-byte aligned; allocate it with epx.empty (or copy with "
                 "epx.asarray)", fn, name, align)
    if writable and not flags.writeable:
        _invalid("%s: %s is read-only; pass a writable array", fn, name)
    return address


def _bf16_dtypes():
    try:
        __import__("ml_dtypes")  # registers numpy's "bfloat16" dtype, when installed
        return (np.dtype(np.uint16), np.dtype("bfloat16"))
    except (ImportError, TypeError):
        return (np.dtype(np.uint16),)


_PAYLOAD_DTYPES = {DType.FLOAT32: (np.dtype(np.float32),), DType.BFLOAT16: _bf16_dtypes(),
                   DType.FLOAT16: (np.dtype(np.float16),)}


def _payload_dtypes(dtype):
    """The numpy dtypes accepted for a payload of an epx dtype."""
    return _PAYLOAD_DTYPES[dtype]


_I32 = (np.dtype(np.int32),)
_I64 = (np.dtype(np.int64),)
_F32 = (np.dtype(np.float32),)


def convert(src, dst_dtype, src_dtype=None, out=None):
    """Converts an array between epx dtypes on the host (epx_convert: round to
    nearest even). src_dtype defaults to what src's numpy dtype carries
    (uint16 is bfloat16). Returns an aligned array of dst_dtype's carrier."""
    dst_dtype = _as_dtype(dst_dtype)
    src_dtype = _as_dtype(src.dtype if src_dtype is None else src_dtype)
    fn = "epx.convert"
    _ptr(src, fn, "src", _payload_dtypes(src_dtype), (None,) * np.ndim(src), align=1)
    if out is None:
        out = empty(src.shape, dst_dtype)
    _ptr(out, fn, "out", _payload_dtypes(dst_dtype), src.shape, align=1, writable=True)
    _check(lib.epx_convert(int(dst_dtype), out.ctypes.data, int(src_dtype), src.ctypes.data,
                           src.size))
    return out


def to_bf16(a, out=None):
    """float32 -> bfloat16 carried as uint16, rounded to nearest even by
    epx_convert (other dtypes are cast to float32 first)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return convert(a, DType.BFLOAT16, DType.FLOAT32, out)


def from_bf16(a, out=None):
    """bfloat16 carried as uint16 -> float32 (exact)."""
    return convert(a, DType.FLOAT32, DType.BFLOAT16, out)


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


def fp8_scale_shape(format, hidden):
    """(scale_cols, numpy dtype) of one row's scales in an fp8 format
    (epx_fp8_scale_shape): float32 per 128, int32 words of 4 UE8M0 bytes per
    512, uint8 E8M0 per 32."""
    cols, size = ctypes.c_int64(), ctypes.c_size_t()
    _check(lib.epx_fp8_scale_shape(int(FP8Format(format)), int(hidden), ctypes.byref(cols),
                                   ctypes.byref(size)))
    dt = np.uint8 if FP8Format(format) == FP8Format.MXFP8 else (
        np.float32 if FP8Format(format) == FP8Format.E4M3_F32_128 else np.int32)
    return int(cols.value), np.dtype(dt)


def quantize(x, format, dtype=None):
    """x [rows, H] (float32, bfloat16 as uint16 or named, float16) -> (x_q
    [rows, H] uint8 e4m3fn bytes, x_scales [rows, scale_cols]) with the
    format's quantizer, bit for bit the peers' formula (epx_quantize)."""
    src_dtype = _as_dtype(dtype if dtype is not None else x.dtype)
    x = np.ascontiguousarray(x)
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
    rows, hidden = x_q.shape
    cols, sdt = fp8_scale_shape(format, hidden)
    if x_scales.shape != (rows, cols) or x_scales.dtype.itemsize != sdt.itemsize:
        _invalid("dequantize: x_scales is %s %s; pass [%d, %d] %s", x_scales.dtype,
                 _shape_text(x_scales.shape), rows, cols, sdt)
    out = empty((rows, hidden), numpy_dtype(dtype))
    _check(lib.epx_dequantize(int(format), int(dtype), rows, hidden, x_q.ctypes.data,
                              x_scales.ctypes.data, out.ctypes.data))
    return out


@dataclass
class RouteResult:
    """What :func:`route` (and :func:`reference_route`) returns. Optional
    outputs are None when not asked for."""
    topk_idx: np.ndarray                  # [T, K] int32 expert ids, best first; -1 = dropped
    topk_w: np.ndarray                    # [T, K] float32 (float64 from the reference); 0 dropped
    locations: Optional[np.ndarray]       # [T, K] int32 slot in the expert's queue; -1: dropped
    expert_counts: Optional[np.ndarray]   # [E] int32 routes chosen per expert before dropping
    aux_loss: Optional[float]
    z_loss: Optional[float]
    capacity: int                         # C in capacity mode, 0 in dropless mode
    nonfinite_tokens: int                 # tokens dropped for NaN/Inf logits (-1: not counted)
    config: RouteConfig                   # the config it was routed with
    # The arrays config.token_mask / config.aux_loss_expert_counts point to
    # (kept alive with the config, for route_backward).
    token_mask: Optional[np.ndarray] = None
    aux_loss_expert_counts: Optional[np.ndarray] = None


def _route_config(config, logits_shape, fields):
    if config is None:
        if "num_experts" not in fields and len(logits_shape) == 2:
            fields = dict(fields, num_experts=logits_shape[1])
        return RouteConfig(**fields)
    if not isinstance(config, RouteConfig):
        raise TypeError("epx.route: config is a %s; pass an epx.RouteConfig"
                        % type(config).__name__)
    return config.copy(**fields) if fields else config


def _host_config(config, fn):
    if config.device != Device.CPU:
        _refuse(Status.ERROR_UNSUPPORTED, "%s: config.device is EPX_DEVICE_CUDA; numpy arrays are "
                "host memory: use epx.torch.route for device tensors", fn)


def _route_arrays(config, fn, T, token_mask, aux_loss_expert_counts):
    """The config's two memory fields from arrays: token_mask [T] (bool or
    uint8, nonzero = a real token) and aux_loss_expert_counts [E] (float32,
    e.g. from route_sum_counts). Returns the config (a copy pointing at the
    arrays when any is given) and the arrays it points to."""
    if token_mask is None and aux_loss_expert_counts is None:
        return config, None, None
    fields = {}
    if token_mask is not None:
        if isinstance(token_mask, np.ndarray) and token_mask.dtype == np.bool_:
            token_mask = token_mask.view(np.uint8)
        token_mask = asarray(token_mask, np.uint8, 1) if isinstance(token_mask, np.ndarray) \
            else token_mask
        fields["token_mask"] = _ptr(token_mask, fn, "token_mask", (np.dtype(np.uint8),), (T,),
                                    align=1)
    if aux_loss_expert_counts is not None:
        E = int(config.num_experts)
        if isinstance(aux_loss_expert_counts, np.ndarray):
            aux_loss_expert_counts = asarray(aux_loss_expert_counts, np.float32, 4)
        fields["aux_loss_expert_counts"] = _ptr(aux_loss_expert_counts, fn,
                                                "aux_loss_expert_counts", _F32, (E,))
    return config.copy(**fields), token_mask, aux_loss_expert_counts


def _route_outputs(T, K, E, locations, expert_counts, losses, w_dtype):
    Kc = max(K, 0)
    idx, w = empty((T, Kc), np.int32), empty((T, Kc), w_dtype)
    loc = empty((T, Kc), np.int32) if locations else None
    counts = empty((max(E, 0),), np.int32) if expert_counts else None
    aux, z = (empty((1,), w_dtype), empty((1,), w_dtype)) if losses else (None, None)
    return idx, w, loc, counts, aux, z


def _data(a):
    return a.ctypes.data if a is not None else None


def _route_inputs(fn, logits, config, fields, bias, token_mask, aux_loss_expert_counts):
    """What :func:`route` and :func:`reference_route` check and pass alike:
    the host config (the two memory fields filled), the logits' and bias'
    pointers, the mask and the global counts arrays kept alive."""
    config = _route_config(config, np.shape(logits), fields)
    _host_config(config, fn)
    _route_config_check(config)
    E = int(config.num_experts)
    pl = _ptr(logits, fn, "logits", _F32, (None, E if E > 0 else None))
    pb = _ptr(bias, fn, "bias", _F32, (E,), optional=True)
    config, mask, gcounts = _route_arrays(config, fn, logits.shape[0], token_mask,
                                          aux_loss_expert_counts)
    return config, pl, pb, mask, gcounts


def _route_config_check(config):
    """Checks config as epx_route does (refused in its words) by routing no
    tokens: before any output is sized from its numbers (top_k = 2**31 - 1
    would otherwise be a [T, 2**31 - 1] allocation first)."""
    out = _lib.RouteOutput()
    _check(lib.epx_route(ctypes.byref(config), 0, None, None, ctypes.byref(out)))


def route(logits, config=None, *, bias=None, token_mask=None, aux_loss_expert_counts=None,
          locations=True, expert_counts=True, losses=True, **fields):
    """Routes T tokens (epx_route): logits [T, E] float32 -> :class:`RouteResult`.

    config is a :class:`RouteConfig`; keyword arguments set its fields (with
    no config, num_experts defaults to E), every routing option included
    (score_fn, num_groups, capacity_arithmetic, renormalize_after_drop,
    aux_counts, aux_loss_sequences, aux_loss_tokens, random_seed, ...).
    bias [E] float32 shifts selection only. token_mask [T] (bool/uint8, 0 =
    padding) and aux_loss_expert_counts [E] float32 (the global aux loss's
    counts, from :func:`route_sum_counts`) fill the config's two memory
    fields. locations / expert_counts / losses=False skip those outputs.
    """
    fn = "epx.route"
    config, pl, pb, mask, gcounts = _route_inputs(fn, logits, config, fields, bias, token_mask,
                                                  aux_loss_expert_counts)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    idx, w, loc, counts, aux, z = _route_outputs(T, K, E, locations, expert_counts, losses,
                                                 np.float32)
    out = _lib.RouteOutput()
    out.topk_idx, out.topk_w, out.locations = idx.ctypes.data, w.ctypes.data, _data(loc)
    out.expert_counts, out.aux_loss, out.z_loss = _data(counts), _data(aux), _data(z)
    _check(lib.epx_route(ctypes.byref(config), T, pl, pb, ctypes.byref(out)))
    return RouteResult(idx, w, loc, counts, float(aux[0]) if losses else None,
                       float(z[0]) if losses else None, int(out.capacity),
                       int(out.nonfinite_tokens), config.copy(), mask, gcounts)


def reference_route(logits, config=None, *, bias=None, token_mask=None,
                    aux_loss_expert_counts=None, **fields):
    """The routing reference (epx_reference_route): epx_route's spec in
    float64, host memory, with the same arguments as :func:`route`. Returns a
    :class:`RouteResult` whose topk_w is float64 and nonfinite_tokens -1 (the
    reference does not count them). The oracle of the routing tests: integers
    agree with :func:`route` exactly, weights and losses to about 1e-5
    relative (inputs away from float32 ties)."""
    fn = "epx.reference_route"
    config, pl, pb, mask, gcounts = _route_inputs(fn, logits, config, fields, bias, token_mask,
                                                  aux_loss_expert_counts)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    idx, w, loc, counts, aux, z = _route_outputs(T, K, E, True, True, True, np.float64)
    cap = ctypes.c_int32(0)
    _check(lib.epx_reference_route(ctypes.byref(config), T, pl, pb, idx.ctypes.data,
                                   w.ctypes.data, loc.ctypes.data, counts.ctypes.data,
                                   aux.ctypes.data, z.ctypes.data, ctypes.byref(cap)))
    return RouteResult(idx, w, loc, counts, float(aux[0]), float(z[0]), int(cap.value), -1,
                       config.copy(), mask, gcounts)


def _backward_args(fn, logits, topk_idx, grad_topk_w, config, bias, token_mask,
                   aux_loss_expert_counts, fields):
    """The checked arguments of the two route backward calls."""
    if isinstance(topk_idx, RouteResult):
        r = topk_idx
        if config is None:
            config = r.config
        token_mask = r.token_mask if token_mask is None else token_mask
        if aux_loss_expert_counts is None:
            aux_loss_expert_counts = r.aux_loss_expert_counts
        topk_idx = r.topk_idx
    config = _route_config(config, np.shape(logits), fields)
    _host_config(config, fn)
    E, K = int(config.num_experts), int(config.top_k)
    pl = _ptr(logits, fn, "logits", _F32, (None, E if E > 0 else None))
    T = logits.shape[0]
    config, mask, gcounts = _route_arrays(config, fn, T, token_mask, aux_loss_expert_counts)
    pb = _ptr(bias, fn, "bias", _F32, (E,), optional=True)
    pi = _ptr(topk_idx, fn, "topk_idx", _I32, (T, K))
    pg = _ptr(grad_topk_w, fn, "grad_topk_w", _F32, (T, K), optional=True)
    return config, (mask, gcounts), T, E, pl, pb, pi, pg


def route_backward(logits, topk_idx, grad_topk_w=None, config=None, *, bias=None,
                   grad_aux_loss=0.0, grad_z_loss=0.0, token_mask=None,
                   aux_loss_expert_counts=None, out=None, **fields):
    """Gradient of :func:`route` (epx_route_backward): returns grad_logits [T, E].

    topk_idx is the forward's [T, K] output, or its RouteResult (whose config,
    token_mask and aux_loss_expert_counts are then used unless given).
    grad_topk_w [T, K] float32 (None = zeros); grad_aux_loss / grad_z_loss
    are the losses' gradients.
    """
    fn = "epx.route_backward"
    config, kept, T, E, pl, pb, pi, pg = _backward_args(
        fn, logits, topk_idx, grad_topk_w, config, bias, token_mask, aux_loss_expert_counts,
        fields)
    if out is None:
        out = empty((T, max(E, 0)), np.float32)
    po = _ptr(out, fn, "out", _F32, (T, E), writable=True)
    _check(lib.epx_route_backward(ctypes.byref(config), T, pl, pb, pi, pg, float(grad_aux_loss),
                                  float(grad_z_loss), po))
    del kept
    return out


def reference_route_backward(logits, topk_idx, grad_topk_w=None, config=None, *, bias=None,
                             grad_aux_loss=0.0, grad_z_loss=0.0, token_mask=None,
                             aux_loss_expert_counts=None, **fields):
    """The float64 gradient of :func:`route_backward`
    (epx_reference_route_backward), same arguments: grad_logits [T, E]
    float64."""
    fn = "epx.reference_route_backward"
    config, kept, T, E, pl, pb, pi, pg = _backward_args(
        fn, logits, topk_idx, grad_topk_w, config, bias, token_mask, aux_loss_expert_counts,
        fields)
    out = empty((T, max(E, 0)), np.float64)
    _check(lib.epx_reference_route_backward(ctypes.byref(config), T, pl, pb, pi, pg,
                                            float(grad_aux_loss), float(grad_z_loss),
                                            out.ctypes.data))
    del kept
    return out


def _host_counts(counts):
    """Per-expert counts as a flat int32 host array (a torch tensor is
    brought to the host). Not checked here: the library checks them and,
    the calls being collective, tells the peers of a refusal (a refusal in
    Python would leave them waiting until the timeout)."""
    if hasattr(counts, "detach") and hasattr(counts, "cpu"):  # a torch tensor
        counts = counts.detach().cpu().numpy()
    a = np.ascontiguousarray(counts, dtype=np.int32).reshape(-1)
    return a, (a.ctypes.data if a.size else None)


def route_capacity(num_tokens, config=None, **fields):
    """The capacity C that :func:`route` reports for num_tokens tokens under
    config (or a RouteConfig of the keyword fields), without routing
    (epx_route_capacity_of): capacity_arithmetic's C, at least
    min_capacity; 0 in dropless mode. E.g. the capacity of a buffer sized
    for max_tokens_per_rank."""
    config = _route_config(config, (), fields)
    cap = ctypes.c_int32(0)
    tokens = _c_int(num_tokens, ctypes.c_int64, "epx.route_capacity", "num_tokens")
    _check(lib.epx_route_capacity_of(ctypes.byref(config), tokens, ctypes.byref(cap)))
    return int(cap.value)


def route_agree_capacity(comm, expert_counts):
    """The capacity of dropless routing agreed across the comm's ranks
    (epx_route_agree_capacity, collective): the largest expert_counts[e] on
    any rank, as an int. expert_counts [E] is this rank's route output
    (RouteResult.expert_counts). DeepSpeed's drop_tokens=False: the dropless
    locations are all below it, so the routing feeds the capacity layout."""
    a, pa = _host_counts(expert_counts)
    cap = ctypes.c_int32(0)
    _check(lib.epx_route_agree_capacity(comm._handle("epx.route_agree_capacity"), a.size, pa,
                                        ctypes.byref(cap)))
    return int(cap.value)


def route_sum_counts(comm, local_counts):
    """Per-expert counts summed over the comm's ranks in rank order
    (epx_route_sum_counts, collective): [E] float32, ready for
    aux_loss_expert_counts of the global aux loss (with aux_loss_tokens =
    the global batch's tokens)."""
    a, pa = _host_counts(local_counts)
    out = empty((max(a.size, 1),), np.float32)
    _check(lib.epx_route_sum_counts(comm._handle("epx.route_sum_counts"), a.size, pa,
                                    out.ctypes.data))
    return out


# ---------------------------------------------------------------------------
# Objects: ownership and the order of release
# ---------------------------------------------------------------------------
#
# A child holds a strong reference to its parent (Handle -> Buffer -> Comm ->
# LocalWorld; a Recorder -> the Buffers it recorded on), so garbage collection
# can never free a parent before its children; a parent keeps weak references
# to its children so that close() can release them first.


# Buffers and recorders by a small integer id (their `id` attribute): what
# epx.torch's custom ops take in place of the object (an op's arguments are
# tensors and numbers). Weak: the id does not keep the object alive.
_BUFFERS = weakref.WeakValueDictionary()
_RECORDERS = weakref.WeakValueDictionary()
_next_id = itertools.count(1)


def _register(table, obj):
    i = next(_next_id)
    table[i] = obj
    return i


def _released(fn, what, fix):
    _refuse(Status.ERROR_INVALID_HANDLE, "%s: the %s was %s", fn, what, fix)


class _Closable:
    """A library object that close() releases: a context manager, with
    `closed` telling whether it has been."""

    @property
    def closed(self):
        return self._ptr is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _busy(message):
    """EPX_ERROR_BUSY from a close(), unless an exception is already
    propagating through that close (a ``finally`` block, a ``with`` exit, an
    ``except`` block): raising would replace it, so the message becomes a
    note on it instead, and the object stays open (to be closed later, or by
    garbage collection)."""
    unwinding = sys.exc_info()[1]
    if unwinding is None:
        _refuse(Status.ERROR_BUSY, message)
    if hasattr(unwinding, "add_note"):
        unwinding.add_note("(epx: EPX_ERROR_BUSY: %s; it stays open)" % message)


def _destroy(obj, destroy, lock=None):
    """Destroys obj's pointer with destroy(ptr); when the library answers
    EPX_ERROR_BUSY the object stays open (and the error is raised, see
    _busy)."""
    with lock if lock is not None else contextlib.nullcontext():
        ptr, obj._ptr = obj._ptr, None
    if ptr is None:
        return
    status = destroy(ptr)
    if status == Status.ERROR_BUSY:
        obj._ptr = ptr
        _busy(lib.epx_last_error().decode("utf-8", "replace"))
        return
    _check(status)


class Comm(_Closable):
    """A group of ranks (epx_comm_t). Make one with :meth:`create_self`,
    :meth:`LocalWorld.comm` or :meth:`from_mpi`.

    close() is collective for local and MPI comms (every rank closes);
    it closes the comm's buffers first. Garbage collection closes only a
    one-rank comm: a collective close from a collector could wait on peers.
    """

    def __init__(self, _ptr_value, _world=None):
        self._ptr = _ptr_value
        self._world = _world
        self._lock = threading.RLock()
        self._buffers = weakref.WeakSet()
        r, s = ctypes.c_int32(), ctypes.c_int32()
        _check(lib.epx_comm_rank(self._ptr, ctypes.byref(r)))
        _check(lib.epx_comm_size(self._ptr, ctypes.byref(s)))
        self.rank, self.size = r.value, s.value

    @classmethod
    def create_self(cls):
        """A comm of one rank (epx_comm_create_self)."""
        p = ctypes.c_void_p()
        _check(lib.epx_comm_create_self(ctypes.byref(p)))
        return cls(p.value)

    @classmethod
    def from_mpi(cls, mpi_comm, config=None, **fields):
        """The MPI transport over an mpi4py communicator (or the address of an
        MPI_Comm); collective. The library duplicates it."""
        if config is None:
            config = CommConfig(**fields)
        elif fields:
            config = config.copy(**fields)
        if isinstance(mpi_comm, int):
            address = mpi_comm
        else:
            from mpi4py import MPI
            address = MPI._addressof(mpi_comm)
        p = ctypes.c_void_p()
        _check(lib.epx_comm_create_mpi(address, ctypes.byref(config), ctypes.byref(p)))
        return cls(p.value)

    @classmethod
    def from_shm(cls, name, rank, size, config=None, **fields):
        """The shm transport (epx_comm_create_shm): `size` processes of one
        host meeting in POSIX shared memory under `name` (the same on every
        rank, new for every comm); collective. No MPI needed."""
        if config is None:
            config = CommConfig(**fields)
        elif fields:
            config = config.copy(**fields)
        p = ctypes.c_void_p()
        rank = _c_int(rank, ctypes.c_int32, "Comm.from_shm", "rank")
        size = _c_int(size, ctypes.c_int32, "Comm.from_shm", "size")
        _check(lib.epx_comm_create_shm(str(name).encode(), rank, size, ctypes.byref(config),
                                       ctypes.byref(p)))
        return cls(p.value)

    def _handle(self, fn):
        if self._ptr is None:
            _released(fn, "comm", "closed; create a new one")
        return self._ptr

    def buffer(self, config=None, **fields):
        """A :class:`Buffer` over this comm (collective)."""
        return Buffer(self, config, **fields)

    def barrier(self):
        """epx_comm_barrier (collective; bounded by the comm's timeout)."""
        _check(lib.epx_comm_barrier(self._handle("Comm.barrier")))

    def allgather(self, send):
        """epx_comm_allgather (collective): every rank's array `send` (the
        same shape and dtype on every rank; any numpy array) -> [size, *shape]
        with block s from rank s."""
        fn = "Comm.allgather"
        a = np.ascontiguousarray(send)
        recv = empty((self.size,) + a.shape, a.dtype)
        _check(lib.epx_comm_allgather(self._handle(fn), a.ctypes.data if a.nbytes else None,
                                      recv.ctypes.data if recv.nbytes else None, a.nbytes))
        return recv

    def route_agree_capacity(self, expert_counts):
        """:func:`route_agree_capacity` over this comm."""
        return route_agree_capacity(self, expert_counts)

    def route_sum_counts(self, local_counts):
        """:func:`route_sum_counts` over this comm."""
        return route_sum_counts(self, local_counts)

    def close(self):
        """Closes the comm's buffers (and their handles), then the comm
        (epx_comm_destroy, collective). Closing a closed comm does nothing."""
        with self._lock:
            buffers = list(self._buffers)
        for b in buffers:
            b.close()
        _destroy(self, lib.epx_comm_destroy, self._lock)

    def __del__(self):
        try:
            if self._ptr is not None and self.size == 1:
                self.close()
        except Exception:
            pass

    def __repr__(self):
        return "<epx.Comm rank %d of %d%s>" % (self.rank, self.size,
                                               " closed" if self.closed else "")


class LocalWorld(_Closable):
    """W ranks as threads of this process (epx_local_world_create). Each
    rank's thread calls :meth:`comm` with its rank; see :func:`run_local`."""

    def __init__(self, size, config=None, **fields):
        if config is None:
            config = CommConfig(**fields)
        elif fields:
            config = config.copy(**fields)
        p = ctypes.c_void_p()
        size = _c_int(size, ctypes.c_int32, "LocalWorld", "size")
        _check(lib.epx_local_world_create(size, ctypes.byref(config), ctypes.byref(p)))
        self._ptr = p.value
        self.size = int(size)
        self.config = config.copy()

    def comm(self, rank):
        """This rank's comm (epx_comm_create_local; collective over the world)."""
        if self._ptr is None:
            _released("LocalWorld.comm", "local world", "closed; create a new one")
        p = ctypes.c_void_p()
        rank = _c_int(rank, ctypes.c_int32, "LocalWorld.comm", "rank")
        _check(lib.epx_comm_create_local(self._ptr, rank, ctypes.byref(p)))
        return Comm(p.value, self)

    def close(self):
        """epx_local_world_destroy: after every comm of the world is closed
        (EpxError EPX_ERROR_BUSY otherwise)."""
        _destroy(self, lib.epx_local_world_destroy)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def run_local(world_size, fn, *args, timeout_seconds=None, **kwargs):
    """Runs ``fn(comm, *args, **kwargs)`` on `world_size` ranks of the local
    transport, one Python thread each, and returns the results by rank.

    Each rank's comm is closed when its fn returns (closing what it left
    open). If a rank raises, the exception of the lowest such rank is raised
    once every thread has finished; a rank whose peers stopped answering
    gets EPX_ERROR_TIMEOUT after timeout_seconds (the comm's default when
    None), so keep it short in tests. One rank runs on the calling thread
    with the self comm.
    """
    if world_size == 1:
        with Comm.create_self() as comm:
            return [fn(comm, *args, **kwargs)]
    fields = {} if timeout_seconds is None else {"timeout_seconds": float(timeout_seconds)}
    world = LocalWorld(world_size, **fields)
    results = [None] * world_size
    errors = [None] * world_size

    def rank_main(rank):
        try:
            comm = world.comm(rank)
        except BaseException as e:  # noqa: B902  (reported to the caller below)
            errors[rank] = e
            return
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except BaseException as e:  # noqa: B902
            errors[rank] = e
        finally:
            try:
                comm.close()
            except BaseException as e:  # noqa: B902
                if errors[rank] is None:
                    errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,), name="epx-rank-%d" % r, daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in range(world_size) if errors[r] is not None]
    try:
        world.close()
    except EpxError:
        if not failed:
            raise  # else a rank's own error, raised below, is the cause
    # The cause before its echoes: a rank's own error before peers' TIMEOUT/PEER_FAILED.
    echoes = (Status.ERROR_TIMEOUT, Status.ERROR_PEER_FAILED)
    if failed:
        causes = [r for r in failed if getattr(errors[r], "status", None) not in echoes]
        rank = (causes or failed)[0]
        err = errors[rank]
        if hasattr(err, "add_note"):
            err.add_note("(raised on rank %d of %d in epx.run_local)" % (rank, world_size))
        raise err
    return results


@dataclass(frozen=True)
class HandleStats:
    """epx_handle_stats_t: rows and bytes this rank sends to / receives from
    other ranks in dispatch (self excluded), and the rows it sends itself."""
    send_rows: int
    recv_rows: int
    send_bytes: int
    recv_bytes: int
    local_rows: int


@dataclass(frozen=True)
class RecorderStats:
    """epx_recorder_stats_t."""
    records: int
    replays: int
    fallbacks: int
    bytes_held: int
    bytes_avoided: int


class Buffer(_Closable):
    """The exchange memory of one MoE layer over a comm (epx_buffer_create,
    collective). config is a :class:`BufferConfig`; keyword arguments set its
    fields (dtype may also be a name or numpy dtype)."""

    def __init__(self, comm, config=None, **fields):
        if "dtype" in fields:
            fields["dtype"] = _as_dtype(fields["dtype"])
        if config is None:
            config = BufferConfig(**fields)
        elif fields:
            config = config.copy(**fields)
        ptr = comm._handle("Buffer")
        p = ctypes.c_void_p()
        _check(lib.epx_buffer_create(ptr, ctypes.byref(config), ctypes.byref(p)))
        # A successful creation may still leave a note: why the fused path
        # was refused (every peer then takes the host path; epx.h,
        # EPX_PATH_AUTO). Empty where there is none.
        self.creation_note = lib.epx_last_error().decode("utf-8", "replace")
        self._ptr = p.value
        self.comm = comm
        self.config = config.copy()
        self.dtype = DType(config.dtype)
        self.device = Device(config.device)
        self.hidden = int(config.hidden)
        self.num_experts = int(config.num_experts)
        self.experts_per_rank = self.num_experts // comm.size
        self.layout = Layout(config.layout)
        self.stream = config.stream  # the CUDA stream of its calls (set_stream changes it)
        self._payload = _payload_dtypes(self.dtype)
        self._lock = threading.RLock()
        self._handles = weakref.WeakSet()
        with comm._lock:
            comm._buffers.add(self)
        self.id = _register(_BUFFERS, self)

    # -- state ---------------------------------------------------------------

    def _handle_ptr(self, fn):
        if self._ptr is None:
            _released(fn, "buffer", "closed; create a new one")
        return self._ptr

    @property
    def np_dtype(self):
        """The numpy dtype of payload arrays (uint16 for bfloat16)."""
        return _NP_OF_DTYPE[self.dtype]

    @property
    def max_tokens(self):
        """Agreed tokens per rank (0 until the first dispatch_layout agrees it)."""
        v = ctypes.c_int64()
        _check(lib.epx_buffer_max_tokens(self._handle_ptr("Buffer.max_tokens"), ctypes.byref(v)))
        return v.value

    def max_recv_rows(self):
        """Upper bound of any handle's recv rows on this buffer."""
        v = ctypes.c_int64()
        _check(lib.epx_buffer_max_recv_rows(self._handle_ptr("Buffer.max_recv_rows"),
                                            ctypes.byref(v)))
        return v.value

    def peer_paths(self):
        """How this buffer moves rows to each rank of its comm
        (epx_buffer_peer_paths, not collective): a list of
        :class:`ExchangePath` (FUSED or HOST), one per rank, this rank's own
        entry included: on the fused path FUSED for the ranks reached by
        load/store (NVLink) and HOST for the others, which NCCL's host API
        serves inside the same calls. HOST everywhere on CPU buffers and
        one-rank buffers;
        where the fused path was refused at creation, ``creation_note`` says
        why."""
        n = self.comm.size
        paths = (ctypes.c_int32 * n)()
        _check(lib.epx_buffer_peer_paths(self._handle_ptr("Buffer.peer_paths"), paths))
        return [ExchangePath(v) for v in paths]

    def set_stream(self, stream):
        """The CUDA stream (a cudaStream_t as an int) of later calls."""
        _check(lib.epx_buffer_set_stream(self._handle_ptr("Buffer.set_stream"), stream))
        self.stream = stream

    def close(self):
        """Releases the handles this Python code still holds on the buffer,
        then destroys it (epx_buffer_destroy, not collective). A recorder
        holding handles keeps it busy: EpxError EPX_ERROR_BUSY, and the buffer
        stays open until the recorder is closed (where an exception is already
        propagating through the close, the BUSY becomes a note on it rather
        than replacing it). Closing twice does nothing."""
        with self._lock:
            handles = list(self._handles)
        held = [h for h in handles if h._autograd and not h.released]
        if held:
            _busy("Buffer.close: %d handle(s) of this buffer are held by epx.torch (an autograd "
                  "graph whose backward has not run yet, or a Dispatched result still "
                  "referenced), and the backward would replay them; run the backward, or drop "
                  "those outputs, before closing" % len(held))
            return
        for h in handles:
            h.release()
        _destroy(self, lib.epx_buffer_destroy, self._lock)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "<epx.Buffer %s H=%d E=%d rank %d of %d%s>" % (
            self.dtype.name.lower(), self.hidden, self.num_experts, self.comm.rank, self.comm.size,
            " closed" if self.closed else "")

    def _host(self, fn):
        if self.device != Device.CPU:
            _refuse(Status.ERROR_UNSUPPORTED, "%s: the buffer is a CUDA buffer and numpy arrays "
                    "are host memory; use epx.torch with CUDA tensors", fn)

    # -- pointer level (used by epx.torch; no argument checks here) ----------

    @contextlib.contextmanager
    def _together(self, op, handle=None):
        """Wraps the checks made in Python before collective call `op`. If one
        refuses, the call is still made, with an address the library refuses
        before reading anything, so that the peers fail at once with
        EPX_ERROR_PEER_FAILED naming this rank (as for a refusal made by the
        library) instead of waiting for this rank until the comm's timeout."""
        try:
            yield
        except EpxError as e:
            if not e.in_library:
                self._fail_peers(op, handle)
            raise

    def _fail_peers(self, op, handle):
        if self._ptr is None or self.comm.size == 1:
            return
        if op == "layout":
            r = _lib.Routing(-1, 1, None, None, None, int(Weighting.IN_COMBINE))
            unused = ctypes.c_void_p()
            lib.epx_dispatch_layout(self._ptr, ctypes.byref(r), None, ctypes.byref(unused))
            return
        if op == "ll_dispatch":
            r = _lib.Routing(-1, 1, None, None, None, int(Weighting.IN_COMBINE))
            unused = ctypes.c_void_p()
            lib.epx_ll_dispatch(self._ptr, ctypes.byref(r), None, None, None, None, ctypes.byref(unused))
            return
        h = handle._ptr if isinstance(handle, Handle) and handle.buffer is self else None
        if h is None:
            return  # a dead or foreign handle: the library returns at once there too
        bad = 1  # a misaligned payload address, refused first
        if op == "ll_combine":
            lib.epx_ll_combine(self._ptr, h, bad, bad)
            return
        if op == "dispatch":
            lib.epx_dispatch(self._ptr, h, bad, bad, -1)
        elif op == "dispatch_fp8":
            lib.epx_dispatch_fp8(self._ptr, h, bad, bad, bad, bad, -1)
        elif op == "dispatch_quantize":
            lib.epx_dispatch_quantize(self._ptr, h, bad, bad, bad, -1)
        elif op == "combine":
            lib.epx_combine(self._ptr, h, bad, bad)
        elif op == "dispatch_backward":
            lib.epx_dispatch_backward(self._ptr, h, bad, bad, None, None)
        elif op == "weights_backward":
            lib.epx_weights_backward(self._ptr, h, bad, bad)
        else:
            lib.epx_combine_backward(self._ptr, h, bad, None, bad, None)

    # -- low-latency decode (config.low_latency = 1; epx.h, "Low-latency decode")

    def ll_shape(self):
        """The fixed receive shape of the low-latency calls: (E_local, W *
        max_tokens, H) expert-major (DeepEP's), (W, max_tokens, H) rank-major;
        recv_count has its first dimension."""
        W, m = self.comm.size, self.max_tokens
        if self.layout == Layout.RANK_MAJOR:
            return (W, m, self.hidden)
        return (self.experts_per_rank, W * m, self.hidden)

    def _ll_dispatch(self, step_tokens, top_k, idx, w, weighting, num_tokens, x, recv_x, recv_count,
                     send_only, rows=None):
        """epx_ll_dispatch(_send) on addresses; num_tokens an address or None,
        rows the routing's rows when num_tokens is given."""
        fn = "Buffer.ll_dispatch"
        r = _lib.Routing(int(step_tokens if rows is None else rows), int(top_k), idx, w, None,
                         int(weighting))
        p = ctypes.c_void_p()
        call = lib.epx_ll_dispatch_send if send_only else lib.epx_ll_dispatch
        _check(call(self._handle_ptr(fn), ctypes.byref(r), num_tokens, x, recv_x, recv_count,
                    ctypes.byref(p)))
        return Handle(self, p.value, int(step_tokens), int(top_k), Weighting(weighting))

    def ll_dispatch(self, x, topk_idx, topk_w=None, *, num_tokens=None,
                    weighting=Weighting.IN_COMBINE, out=None, recv_count=None, send_only=False):
        """One decode step's dispatch (epx_ll_dispatch, collective; DeepEP's
        low_latency_dispatch) -> (recv_x, recv_count, handle).

        x [T, H], topk_idx [T, K] int32, topk_w [T, K] float32; num_tokens:
        the step's count when x and the routing hold more rows (T is then
        their rows). recv_x has the fixed shape ll_shape(): expert e's rows
        are recv_x[e, :recv_count[e]] (rank-major: source rank s's), in the
        normal layout's order; handle.recv_source() gives each row's (rank,
        token) over the flattened rows. send_only: epx_ll_dispatch_send;
        call ll_complete(handle) before reading recv_x and recv_count."""
        fn = "Buffer.ll_dispatch"
        with self._together("ll_dispatch"):
            T, K, pi, pw, _ = self._routing_args(fn, topk_idx, topk_w, None)
            count, step = None, T
            if num_tokens is not None:
                step = int(num_tokens)
                if not 0 <= step <= T:
                    _invalid("%s: num_tokens is %d; pass a count in [0, %d] (the rows of topk_idx)",
                             fn, step, T)
                count = ctypes.c_int32(step)
            px = self._payload_in(x, T, fn, "x")
            shape = self.ll_shape()
            if out is None:
                out = empty(shape, self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, shape, align=PAYLOAD_ALIGNMENT, writable=True)
            if recv_count is None:
                recv_count = empty((shape[0],), np.int32)
            pc = _ptr(recv_count, fn, "recv_count", _I32, (shape[0],), writable=True)
        h = self._ll_dispatch(step, K, pi, pw, weighting,
                              ctypes.addressof(count) if count is not None else None, px, po, pc,
                              send_only, rows=T)
        return out, recv_count, h

    def ll_dispatch_fp8(self, x, topk_idx, topk_w=None, *, x_scales=None, num_tokens=None,
                        weighting=Weighting.IN_COMBINE, send_only=False):
        """The step's dispatch in the buffer's fp8_format (epx_ll_dispatch_fp8;
        DeepEP's use_fp8) -> (recv_x_q, recv_scales, recv_count, handle).
        x [T, H] of the buffer's dtype is quantized on the way (x_scales None),
        or x is e4m3 bytes (uint8) with x_scales [T, scale_cols]. recv_x_q is
        ll_shape() of uint8, recv_scales ll_shape()[:2] + (scale_cols,)
        (row-major, see fp8_scale_shape); each row and its scales are the
        normal fp8 dispatch's. send_only as in ll_dispatch."""
        fn = "Buffer.ll_dispatch_fp8"
        with self._together("ll_dispatch"):
            T, K, pi, pw, _ = self._routing_args(fn, topk_idx, topk_w, None)
            count, step = None, T
            if num_tokens is not None:
                step = int(num_tokens)
                if not 0 <= step <= T:
                    _invalid("%s: num_tokens is %d; pass a count in [0, %d] (the rows of topk_idx)",
                             fn, step, T)
                count = ctypes.c_int32(step)
            cols, sdt = fp8_scale_shape(self.config.fp8_format, self.hidden)
            if x_scales is None:
                px = self._payload_in(x, T, fn, "x")
            else:
                px = _ptr(x, fn, "x", (np.dtype(np.uint8),), (T, self.hidden), align=PAYLOAD_ALIGNMENT)
                x_scales = _ptr(x_scales, fn, "x_scales", (sdt,), (T, cols), align=1)
            shape = self.ll_shape()
            recv_q = empty(shape, np.uint8)
            recv_s = empty(shape[:2] + (cols,), sdt)
            recv_count = empty((shape[0],), np.int32)
        call = lib.epx_ll_dispatch_fp8_send if send_only else lib.epx_ll_dispatch_fp8
        r = _lib.Routing(int(T), int(K), pi, pw, None, int(weighting))
        p = ctypes.c_void_p()
        _check(call(self._handle_ptr(fn), ctypes.byref(r),
                    ctypes.addressof(count) if count is not None else None, px, x_scales,
                    recv_q.ctypes.data, recv_s.ctypes.data, recv_count.ctypes.data, ctypes.byref(p)))
        return recv_q, recv_s, recv_count, Handle(self, p.value, int(step), int(K), Weighting(weighting))

    def ll_combine(self, handle, expert_out, out=None, *, send_only=False):
        """The step's combine (epx_ll_combine, collective; DeepEP's
        low_latency_combine): expert_out in ll_shape() -> out [T, H], the
        normal combine's sums. send_only: epx_ll_combine_send; call
        ll_complete(handle) before reading out."""
        fn = "Buffer.ll_combine"
        with self._together("ll_combine", handle):
            self._host(fn)
            pe = _ptr(expert_out, fn, "expert_out", self._payload, self.ll_shape(),
                      align=PAYLOAD_ALIGNMENT)
            if out is None:
                out = empty((handle.num_tokens, self.hidden), self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, (handle.num_tokens, self.hidden),
                      align=PAYLOAD_ALIGNMENT, writable=True)
        call = lib.epx_ll_combine_send if send_only else lib.epx_ll_combine
        _check(call(self._handle_ptr(fn), handle._use(self, fn), pe, po))
        return out

    def ll_complete(self, handle):
        """Finishes the handle's pending ll_dispatch / ll_combine send (epx_ll_complete)."""
        fn = "Buffer.ll_complete"
        _check(lib.epx_ll_complete(self._handle_ptr(fn), handle._use(self, fn)))

    def _layout(self, num_tokens, top_k, idx, w, loc, weighting, recorder):
        fn = "Buffer.dispatch_layout"
        r = _lib.Routing(int(num_tokens), int(top_k), idx, w, loc, int(weighting))
        with self._together("layout"):
            rec = recorder._handle_ptr(fn) if recorder is not None else None
        p = ctypes.c_void_p()
        _check(lib.epx_dispatch_layout(self._handle_ptr(fn), ctypes.byref(r), rec, ctypes.byref(p)))
        h = Handle(self, p.value, int(num_tokens), int(top_k), Weighting(weighting))
        if recorder is not None:
            recorder._buffers.add(self)
        return h

    def _dispatch(self, handle, x, recv_x, capacity):
        fn = "Buffer.dispatch"
        _check(lib.epx_dispatch(self._handle_ptr(fn), handle._use(self, fn), x, recv_x,
                                int(capacity)))

    def _dispatch_fp8(self, handle, x, x_scales, recv_q, recv_scales, capacity):
        """epx_dispatch_fp8, or epx_dispatch_quantize when x_scales is None."""
        fn = "Buffer.dispatch_fp8"
        if x_scales is None:
            _check(lib.epx_dispatch_quantize(self._handle_ptr(fn), handle._use(self, fn), x, recv_q,
                                             recv_scales, int(capacity)))
        else:
            _check(lib.epx_dispatch_fp8(self._handle_ptr(fn), handle._use(self, fn), x, x_scales,
                                        recv_q, recv_scales, int(capacity)))

    def _combine(self, handle, expert_out, out):
        fn = "Buffer.combine"
        _check(lib.epx_combine(self._handle_ptr(fn), handle._use(self, fn), expert_out, out))

    def _dispatch_backward(self, handle, grad_recv_x, grad_x, x, grad_w):
        fn = "Buffer.dispatch_backward"
        _check(lib.epx_dispatch_backward(self._handle_ptr(fn), handle._use(self, fn), grad_recv_x,
                                         grad_x, x, grad_w))

    def _combine_backward(self, handle, grad_out, expert_out, grad_expert_out, grad_w):
        fn = "Buffer.combine_backward"
        _check(lib.epx_combine_backward(self._handle_ptr(fn), handle._use(self, fn), grad_out,
                                        expert_out, grad_expert_out, grad_w))

    # -- numpy level ---------------------------------------------------------

    def dispatch_layout(self, topk_idx, topk_w=None, locations=None, *,
                        weighting=Weighting.IN_COMBINE, recorder=None):
        """The layout of a dispatch (epx_dispatch_layout, collective) -> :class:`Handle`.

        topk_idx [T, K] int32 (or a :class:`RouteResult`, which also gives
        topk_w and, for the capacity layout, locations); topk_w [T, K] float32
        (None only with Weighting.NONE); locations [T, K] int32 for
        Layout.CAPACITY. recorder: a :class:`Recorder` or None.
        """
        fn = "Buffer.dispatch_layout"
        with self._together("layout"):
            args = self._routing_args(fn, topk_idx, topk_w, locations)
        return self._layout(*args, weighting, recorder)

    def _routing_args(self, fn, topk_idx, topk_w, locations):
        self._host(fn)
        if isinstance(topk_idx, RouteResult):
            rr = topk_idx
            topk_idx = rr.topk_idx
            if topk_w is None:  # also with Weighting.NONE: recv_routing reports them
                topk_w = rr.topk_w
            if locations is None and self.layout == Layout.CAPACITY:
                locations = rr.locations
        if not isinstance(topk_idx, np.ndarray) or topk_idx.ndim != 2:
            _ptr(topk_idx, fn, "topk_idx", _I32, (None, None))
        T, K = topk_idx.shape
        pi = _ptr(topk_idx, fn, "topk_idx", _I32, (T, K))
        pw = _ptr(topk_w, fn, "topk_w", _F32, (T, K), optional=True)
        pl = _ptr(locations, fn, "locations", _I32, (T, K), optional=True)
        return T, K, pi, pw, pl

    def _rows_out(self, out, rows, fn, name):
        """An output payload array of at least `rows` rows ([..., H]): `out`
        checked, or a new [rows, H] one. Returns it, its address and its rows."""
        if out is None:
            out = empty((rows, self.hidden), self.np_dtype)
            return out, out.ctypes.data, rows
        if not isinstance(out, np.ndarray) or out.ndim < 2 or out.shape[-1] != self.hidden:
            _invalid("%s: %s has shape %s; expected [rows, %d]", fn, name, list(np.shape(out)),
                     self.hidden)
        address = _ptr(out, fn, name, self._payload, out.shape, align=PAYLOAD_ALIGNMENT,
                       writable=True)
        return out, address, math.prod(out.shape[:-1])

    def _payload_in(self, a, rows, fn, name):
        return _ptr(a, fn, name, self._payload, (rows, self.hidden), align=PAYLOAD_ALIGNMENT)

    def dispatch(self, handle, x, out=None):
        """x [T, H] -> recv_x [N, H] in the buffer's layout (epx_dispatch,
        collective). out: an array of at least N rows ([..., H], aligned) to
        fill, or None to allocate; returns its first N rows."""
        fn = "Buffer.dispatch"
        with self._together("dispatch", handle):
            self._host(fn)
            n = handle.recv_rows
            px = self._payload_in(x, handle.num_tokens, fn, "x")
            out, po, capacity = self._rows_out(out, n, fn, "out")
        self._dispatch(handle, px, po, capacity)
        return out if capacity == n and out.ndim == 2 else out.reshape(-1, self.hidden)[:n]

    def combine(self, handle, expert_out, out=None):
        """expert_out [N, H] -> out [T, H] = sum_k w[t,k] * expert_out(t,k)
        (epx_combine, collective)."""
        fn = "Buffer.combine"
        with self._together("combine", handle):
            self._host(fn)
            pe = self._payload_in(expert_out, handle.recv_rows, fn, "expert_out")
            if out is None:
                out = empty((handle.num_tokens, self.hidden), self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, (handle.num_tokens, self.hidden),
                      align=PAYLOAD_ALIGNMENT, writable=True)
        self._combine(handle, pe, po)
        return out

    def _grad_w(self, handle, grad_w, needed, inputs_given, fn, input_name, weighting_name):
        """The grad_w array of a backward call (None when not computed)."""
        if grad_w is False or handle.weighting != needed:
            if grad_w is not None and grad_w is not False:
                _invalid("%s: grad_w is given but the handle's weights were not applied in %s; "
                         "pass grad_w=None", fn, weighting_name)
            return None
        if not inputs_given:
            _invalid("%s: %s is None but the handle's weights were applied in %s, so grad_w "
                     "needs the forward's %s; pass it (grad_w is what the router learns from), "
                     "or grad_w=False to skip it", fn, input_name, weighting_name, input_name)
        if grad_w is None:
            return empty((handle.num_tokens, handle.top_k), np.float32)
        _ptr(grad_w, fn, "grad_w", _F32, (handle.num_tokens, handle.top_k), writable=True)
        return grad_w

    def dispatch_backward(self, handle, grad_recv_x, x=None, *, grad_x=None, grad_w=None):
        """grad_recv_x [N, H] -> (grad_x [T, H], grad_w [T, K] or None)
        (epx_dispatch_backward, collective). With Weighting.IN_DISPATCH, grad_w
        needs x (the forward's input); grad_w=False skips it."""
        fn = "Buffer.dispatch_backward"
        with self._together("dispatch_backward", handle):
            self._host(fn)
            pg = self._payload_in(grad_recv_x, handle.recv_rows, fn, "grad_recv_x")
            gw = self._grad_w(handle, grad_w, Weighting.IN_DISPATCH, x is not None, fn, "x",
                              "dispatch")
            if gw is None and x is not None:
                if handle.weighting != Weighting.IN_DISPATCH:
                    _invalid("%s: x is given but the handle's weights were not applied in "
                             "dispatch; pass x=None", fn)
                x = None
            px = self._payload_in(x, handle.num_tokens, fn, "x") if x is not None else None
            if grad_x is None:
                grad_x = empty((handle.num_tokens, self.hidden), self.np_dtype)
            pgx = _ptr(grad_x, fn, "grad_x", self._payload, (handle.num_tokens, self.hidden),
                       align=PAYLOAD_ALIGNMENT, writable=True)
        self._dispatch_backward(handle, pg, pgx, px, gw.ctypes.data if gw is not None else None)
        return grad_x, gw

    def combine_backward(self, handle, grad_out, expert_out=None, *, grad_expert_out=None,
                         grad_w=None):
        """grad_out [T, H] -> (grad_expert_out [N, H], grad_w [T, K] or None)
        (epx_combine_backward, collective). With Weighting.IN_COMBINE, grad_w
        needs expert_out (the forward's input): it is what the router learns
        from; grad_w=False skips it."""
        fn = "Buffer.combine_backward"
        with self._together("combine_backward", handle):
            self._host(fn)
            pg = self._payload_in(grad_out, handle.num_tokens, fn, "grad_out")
            gw = self._grad_w(handle, grad_w, Weighting.IN_COMBINE, expert_out is not None, fn,
                              "expert_out", "combine")
            if gw is None and expert_out is not None:
                if handle.weighting != Weighting.IN_COMBINE:
                    _invalid("%s: expert_out is given but the handle's weights were not applied "
                             "in combine; pass expert_out=None", fn)
                expert_out = None
            pe = (self._payload_in(expert_out, handle.recv_rows, fn, "expert_out")
                  if expert_out is not None else None)
            if grad_expert_out is None:
                grad_expert_out = empty((handle.recv_rows, self.hidden), self.np_dtype)
            pge = _ptr(grad_expert_out, fn, "grad_expert_out", self._payload,
                       (handle.recv_rows, self.hidden), align=PAYLOAD_ALIGNMENT, writable=True)
        self._combine_backward(handle, pg, pe, pge, gw.ctypes.data if gw is not None else None)
        return grad_expert_out, gw

    def weights_backward(self, handle, grad_recv_w, *, grad_w=None):
        """grad_recv_w (the shape of Handle.recv_routing's recv_w: [N], or
        [N, K] for rank-major) -> grad_w [T, K] (epx_weights_backward,
        collective): the gradient of weights the expert applied itself,
        brought home to each route's source slot (0 for slots without one)."""
        fn = "Buffer.weights_backward"
        with self._together("weights_backward", handle):
            self._host(fn)
            shape = ((handle.recv_rows, handle.top_k) if self.layout == Layout.RANK_MAJOR
                     else (handle.recv_rows,))
            pg = _ptr(grad_recv_w, fn, "grad_recv_w", _F32, shape)
            if grad_w is None:
                grad_w = empty((handle.num_tokens, handle.top_k), np.float32)
            pw = _ptr(grad_w, fn, "grad_w", _F32, (handle.num_tokens, handle.top_k), writable=True)
        _check(lib.epx_weights_backward(self._handle_ptr(fn), handle._use(self, fn), pg, pw))
        return grad_w


class Handle:
    """The layout of one dispatch (epx_handle_t; one reference of it). It
    drives dispatch, combine and both backward passes on its buffer.
    release()/close() drops the reference; using it afterwards raises
    EpxError EPX_ERROR_INVALID_HANDLE. Closing the buffer releases it too."""

    _autograd = False  # epx.torch: an autograd graph may still replay it (Buffer.close refuses)

    def __init__(self, buffer, ptr, num_tokens, top_k, weighting):
        self._ptr = ptr
        self.buffer = buffer
        self.num_tokens = num_tokens
        self.top_k = top_k
        self.weighting = weighting
        with buffer._lock:
            buffer._handles.add(self)

    def _use(self, buffer, fn):
        if self._ptr is None:
            _released(fn, "handle", "released (or its buffer closed); keep the Handle open, or "
                      "retain() it, while you still need it")
        if buffer is not None and buffer is not self.buffer:
            _refuse(Status.ERROR_INVALID_HANDLE, "%s: the handle belongs to another buffer; pass "
                    "the buffer its dispatch_layout was called on", fn)
        return self._ptr

    @property
    def released(self):
        return self._ptr is None

    closed = released

    def release(self):
        """Drops this reference (epx_handle_release). Releasing twice does nothing."""
        with self.buffer._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _check(lib.epx_handle_release(ptr))

    close = release

    def retain(self):
        """Another reference to the same layout (epx_handle_retain), released separately."""
        ptr = self._use(None, "Handle.retain")
        _check(lib.epx_handle_retain(ptr))
        return Handle(self.buffer, ptr, self.num_tokens, self.top_k, self.weighting)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self):
        if self._ptr is None:
            return "<epx.Handle released>"
        return "<epx.Handle T=%d K=%d N=%d %s>" % (self.num_tokens, self.top_k, self.recv_rows,
                                                   self.weighting.name)

    _recv_rows = None  # N once read (it never changes; on CUDA a read may wait)

    @property
    def recv_rows(self):
        """Row count N of the receive layout (read once: on CUDA with
        worst_case_sizing the read waits for the stream)."""
        ptr = self._use(None, "Handle.recv_rows")
        if self._recv_rows is None:
            v = ctypes.c_int64()
            _check(lib.epx_handle_recv_rows(ptr, ctypes.byref(v)))
            self._recv_rows = v.value
        return self._recv_rows

    def _host(self, fn):
        self.buffer._host(fn)
        return self._use(None, fn)

    def expert_counts(self):
        """(counts [E_local] int64, offsets [E_local + 1] int64): rows per
        local expert before padding, and each group's first row."""
        ptr = self._host("Handle.expert_counts")
        n = self.buffer.experts_per_rank
        counts, offsets = empty((n,), np.int64), empty((n + 1,), np.int64)
        _check(lib.epx_handle_expert_counts(ptr, counts.ctypes.data, offsets.ctypes.data))
        return counts, offsets

    def recv_routing(self):
        """(recv_expert int32, recv_w float32) of each received row: [N] for
        the expert-major and capacity layouts, [N, K] for rank-major."""
        ptr = self._host("Handle.recv_routing")
        n = self.recv_rows
        shape = (n, self.top_k) if self.buffer.layout == Layout.RANK_MAJOR else (n,)
        expert, w = empty(shape, np.int32), empty(shape, np.float32)
        _check(lib.epx_handle_recv_routing(ptr, expert.ctypes.data, w.ctypes.data))
        return expert, w

    def recv_source(self):
        """(src_rank [N] int32, src_token [N] int32) of each received row (-1 for padding)."""
        ptr = self._host("Handle.recv_source")
        n = self.recv_rows
        rank, token = empty((n,), np.int32), empty((n,), np.int32)
        _check(lib.epx_handle_recv_source(ptr, rank.ctypes.data, token.ctypes.data))
        return rank, token

    def stats(self):
        """:class:`HandleStats` of the dispatch."""
        s = _lib.HandleStatsStruct()
        _check(lib.epx_handle_stats(self._use(None, "Handle.stats"), ctypes.byref(s)))
        return HandleStats(s.send_rows, s.recv_rows, s.send_bytes, s.recv_bytes, s.local_rows)


class Recorder(_Closable):
    """Activation-checkpoint recorder (epx_recorder_t): in RECORD mode each
    dispatch_layout given it is logged; in REPLAY mode each one returns the
    next recorded handle with no exchange. validate: replays hash the routing
    and refuse a difference (EPX_ERROR_REPLAY_MISMATCH, collective)."""

    def __init__(self, validate=True):
        p = ctypes.c_void_p()
        _check(lib.epx_recorder_create(1 if validate else 0, ctypes.byref(p)))
        self._ptr = p.value
        self.validate = bool(validate)
        self.mode = RecorderMode.RECORD
        self._buffers = set()  # strong: the recorded handles keep these buffers busy
        self.id = _register(_RECORDERS, self)

    def _handle_ptr(self, fn):
        if self._ptr is None:
            _released(fn, "recorder", "closed; create a new one")
        return self._ptr

    def set_mode(self, mode):
        """RecorderMode.RECORD or REPLAY (switching to replay rewinds)."""
        _check(lib.epx_recorder_set_mode(self._handle_ptr("Recorder.set_mode"), int(mode)))
        self.mode = RecorderMode(mode)
        return self

    def record(self):
        return self.set_mode(RecorderMode.RECORD)

    def replay(self):
        return self.set_mode(RecorderMode.REPLAY)

    def stats(self):
        s = _lib.RecorderStatsStruct()
        _check(lib.epx_recorder_stats(self._handle_ptr("Recorder.stats"), ctypes.byref(s)))
        return RecorderStats(s.records, s.replays, s.fallbacks, s.bytes_held, s.bytes_avoided)

    def close(self):
        """Releases every handle it holds (epx_recorder_destroy)."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._buffers.clear()
            _check(lib.epx_recorder_destroy(ptr))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------
# Dense references (the oracle of the tests)
# ---------------------------------------------------------------------------


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
