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
# The package's rooms (each opens with what it holds): errors (EpxError and
# its subclasses), arrays (dtypes, aligned arrays, the library's build
# facts), fp8 (scale shapes, quantize), routing (route and its backward),
# comm, buffer, handle (the C objects; ownership: what they share),
# placement (expert placement and replicas: Placement, the planner, the
# weight move),
# references (the dense oracle), semantics (each op's outputs and backward
# pairing, for every binding), torch (the PyTorch binding) and the drop-ins
# (megatron, deepspeed, nemo).
from . import _lib
from ._lib import (AuxCounts, BufferConfig, CapacityArithmetic, CombinePrecision, CommConfig,
                   DType, Device, DropPolicy, Exchange, ExchangePath, FP8Format, Layout, Nonfinite,
                   QueueOrder, RecorderMode, ReplicaRule, RouteConfig, ScoreFn, Status, Weighting)
# _check, _invalid and _refuse: the binding's error helpers, which epx.torch
# and the drop-ins call as epx._invalid(...).
from .errors import (BusyError, CapacityExceededError, _check, CudaError, EpxError, InternalError,
                     _invalid, InvalidArgumentError, InvalidHandleError, OutOfMemoryError,
                     PeerFailedError, _refuse, ReplayMismatchError, ShapeMismatchError,
                     TimeoutError, TransportError, UnsupportedError)
from .arrays import (asarray, convert, dtype_size, empty, from_bf16, has_cuda, has_mpi, has_nccl,
                     library_version, numpy_dtype, PAYLOAD_ALIGNMENT, to_bf16, VERSION, zeros)
from .fp8 import (dequantize, fp8_scale_shape, quantize)
from .routing import (reference_route, reference_route_backward, route, route_agree_capacity,
                      route_backward, route_capacity, route_sum_counts, RouteResult)
from .comm import (Comm, LocalWorld, run_local)
from .buffer import Buffer
from .placement import Placement, placement_move
from .handle import (Handle, HandleStats, Recorder, RecorderStats)
from .references import (reference_dense_combine, reference_dense_dispatch)

lib = _lib.lib
library_path = _lib.path

__version__ = "%d.%d.%d" % _lib.VERSION
CONFIG_VERSION = _lib.CONFIG_VERSION

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
    "ReplicaRule", "Placement", "placement_move",
]

# The C enumerators under their C names (epx.EPX_BFLOAT16, epx.EPX_WEIGHTS_IN_COMBINE, ...).
for _enum, _prefix in ((Status, "EPX_"), (DType, "EPX_"), (Device, "EPX_DEVICE_"),
                       (ScoreFn, "EPX_SCORE_"), (QueueOrder, "EPX_QUEUE_"),
                       (DropPolicy, "EPX_DROP_"), (Nonfinite, "EPX_NONFINITE_"),
                       (CapacityArithmetic, "EPX_CAPACITY_"), (AuxCounts, "EPX_AUX_COUNTS_"),
                       (CombinePrecision, "EPX_COMBINE_"), (ExchangePath, "EPX_PATH_"),
                       (Exchange, "EPX_EXCHANGE_"), (Layout, "EPX_LAYOUT_"),
                       (Weighting, "EPX_WEIGHTS_"), (RecorderMode, "EPX_RECORDER_"),
                       (FP8Format, "EPX_FP8_"), (ReplicaRule, "EPX_REPLICA_")):
    for _member in _enum:
        globals()[_prefix + _member.name] = _member
        __all__.append(_prefix + _member.name)
del _enum, _prefix, _member
