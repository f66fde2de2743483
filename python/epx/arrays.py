"""Numbers and arrays: the dtype names and their numpy dtypes, the library's
build facts (has_cuda, has_mpi, has_nccl, versions), aligned allocation
(empty, zeros, asarray), the argument check of every array a call takes
(_ptr), and the bfloat16 conversions."""
import math

import numpy as np

from . import _lib
from ._lib import DType, lib
from .errors import _check, _invalid


PAYLOAD_ALIGNMENT = 16


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
