"""Loading libepx and declaring its C signatures (ctypes).

Everything here mirrors include/epx.h one to one: the enums, the config and
output structs (with the defaults of the C *_INIT macros) and the prototype
of every public function. The pythonic layer (epx/__init__.py and its rooms) sits on top.
"""
import ctypes
import ctypes.util
import enum
import importlib.util
import operator
import os
import pathlib
import sys

# ---------------------------------------------------------------------------
# Finding the library
# ---------------------------------------------------------------------------

_NAMES = ("libepx.so", "libepx.so.0", "libepx.dylib")


def _candidates():
    """Where libepx is looked for, in order: $EPX_LIBRARY, next to the
    package (where `pip install ./python` puts it), the repository's build
    directory (an in-tree checkout), then the system loader."""
    env = os.environ.get("EPX_LIBRARY")
    if env:
        return [env], True
    here = pathlib.Path(__file__).resolve().parent
    dirs = [here, here.parent, here.parent.parent / "build"]
    paths = [str(d / n) for d in dirs for n in _NAMES]
    return paths, False


def _torch_first(path):
    """A libepx that links NCCL (or the CUDA runtime) must bind to the copy
    torch loads, not a second one: import torch (when installed) before
    loading such a library, so that the process has one NCCL."""
    if "torch" in sys.modules or importlib.util.find_spec("torch") is None:
        return
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return
    if b"libnccl.so" in data or b"libcudart.so" in data:
        import torch  # noqa: F401  (its NCCL, loaded first)


def _open(path):
    _torch_first(path)
    return ctypes.CDLL(path)


def _load():
    paths, from_env = _candidates()
    if from_env:
        try:
            return _open(paths[0]), paths[0]
        except OSError as e:
            raise ImportError(
                "epx: EPX_LIBRARY=%s could not be loaded (%s); point it at the libepx.so "
                "of a build (cmake --build <dir> --target epx)" % (paths[0], e)) from e
    for p in paths:
        if os.path.exists(p):
            return _open(p), p
    system = ctypes.util.find_library("epx")
    for name in ([system] if system else []) + list(_NAMES):
        try:
            return ctypes.CDLL(name), name
        except OSError:
            continue
    raise ImportError(
        "epx: libepx was not found; looked at $EPX_LIBRARY (unset), %s and the system "
        "loader. Build it (cmake -S . -B build && cmake --build build --target epx) or "
        "set EPX_LIBRARY to the path of libepx.so" % ", ".join(paths))


lib, path = _load()

# ---------------------------------------------------------------------------
# Enums (values as in epx.h)
# ---------------------------------------------------------------------------


def _c_enum(name, members):
    """epx.h's enum `name` as an IntEnum: its members, named as in the
    header without the prefix, in the order of their values 0, 1, 2, ..."""
    return enum.IntEnum(name, [(m, v) for v, m in enumerate(members.split())], module=__name__)


Status = _c_enum("Status", "SUCCESS ERROR_INVALID_ARGUMENT ERROR_OUT_OF_MEMORY ERROR_UNSUPPORTED "
                           "ERROR_CAPACITY_EXCEEDED ERROR_SHAPE_MISMATCH ERROR_INVALID_HANDLE "
                           "ERROR_BUSY ERROR_TIMEOUT ERROR_PEER_FAILED ERROR_TRANSPORT "
                           "ERROR_REPLAY_MISMATCH ERROR_CUDA ERROR_INTERNAL")
DType = _c_enum("DType", "FLOAT32 BFLOAT16 FLOAT16")
Device = _c_enum("Device", "CPU CUDA")
ScoreFn = _c_enum("ScoreFn", "SOFTMAX SIGMOID SOFTMAX_AFTER_TOPK SQRT_SOFTPLUS")
QueueOrder = _c_enum("QueueOrder", "BY_CHOICE BY_TOKEN")
DropPolicy = _c_enum("DropPolicy", "BY_POSITION BY_PROBABILITY BY_SCORE BY_RANDOM_PRIORITY")
Nonfinite = _c_enum("Nonfinite", "ERROR DROP")
CapacityArithmetic = _c_enum("CapacityArithmetic", "FLOAT32 FLOAT64")
AuxCounts = _c_enum("AuxCounts", "SELECTED FIRST_CHOICE PLAIN_TOPK")
# HIERARCHICAL: one row per (token, other node), forwarded inside the node
# (CPU); AUTO: HIERARCHICAL across nodes of several ranks, else DEDUP
Exchange = _c_enum("Exchange", "DEDUP COLLECTIVE HIERARCHICAL AUTO")
Layout = _c_enum("Layout", "EXPERT_MAJOR RANK_MAJOR CAPACITY")
CombinePrecision = _c_enum("CombinePrecision", "PARTIALS_FLOAT32 PARTIALS_PAYLOAD")
ExchangePath = _c_enum("ExchangePath", "AUTO HOST FUSED")
FP8Format = _c_enum("FP8Format", "NONE E4M3_F32_128 E4M3_UE8M0_128 MXFP8")
Weighting = _c_enum("Weighting", "IN_COMBINE IN_DISPATCH NONE")
RecorderMode = _c_enum("RecorderMode", "RECORD REPLAY")
ReplicaRule = _c_enum("ReplicaRule", "ROUND_ROBIN CALLER")

CONFIG_VERSION = 1
VERSION = (0, 1, 0)

# ---------------------------------------------------------------------------
# Structs
# ---------------------------------------------------------------------------

_enum = ctypes.c_int

# The range of each integer C type a Python int is stored into: ctypes
# wraps silently (2**32 + 2 into an int32_t is 2, 2**70 into an int64_t 0).
_INT_RANGES = {ctypes.c_int32: ("int32_t", -2 ** 31, 2 ** 31 - 1),
               ctypes.c_uint32: ("uint32_t", 0, 2 ** 32 - 1),
               ctypes.c_int64: ("int64_t", -2 ** 63, 2 ** 63 - 1),
               ctypes.c_uint64: ("uint64_t", 0, 2 ** 64 - 1),
               ctypes.c_void_p: ("a pointer", 0, 2 ** 64 - 1)}


def refuse_invalid(fmt, *args):
    """How an out-of-range field is refused; epx/errors.py replaces it with
    its own (an epx.InvalidArgumentError, a ValueError as this is)."""
    raise ValueError(fmt % args)


def _out_of_range(value, ctype):
    """(value, C type name, low, high) when value is an integer outside
    ctype's range, else None (non-integers are left to ctypes, which
    refuses them itself)."""
    bounds = _INT_RANGES.get(ctype)
    if bounds is None or value is None or isinstance(value, float):
        return None
    try:
        v = operator.index(value)
    except TypeError:
        return None
    return None if bounds[1] <= v <= bounds[2] else (v,) + bounds


def check_int_range(value, ctype, what):
    """Refuses, naming `what`, an integer value outside ctype's range."""
    bad = _out_of_range(value, ctype)
    if bad is not None:
        refuse_invalid("%s is %d, outside the range of its C type %s [%d, %d]; pass a value "
                       "in range", what, *bad)


_FIELD_TYPES = {}  # config class -> {field: ctype}


class _Config(ctypes.Structure):
    """A versioned config: struct_size and version are filled in, every other
    field starts at the C *_INIT macro's value, keyword arguments override."""
    _defaults = {}

    def __init__(self, **fields):
        super().__init__()
        self.struct_size = ctypes.sizeof(self)
        self.version = CONFIG_VERSION
        for name, value in self._defaults.items():
            setattr(self, name, value)
        names = {f[0] for f in self._fields_}
        for name, value in fields.items():
            if name not in names or name in ("struct_size", "version"):
                raise TypeError("%s has no settable field %r; fields: %s" % (
                    type(self).__name__, name,
                    ", ".join(f[0] for f in self._fields_[2:])))
            setattr(self, name, value)

    def copy(self, **fields):
        """A copy with some fields changed."""
        c = type(self)()
        ctypes.memmove(ctypes.byref(c), ctypes.byref(self), ctypes.sizeof(self))
        for name, value in fields.items():
            if name not in {f[0] for f in self._fields_} or name in ("struct_size", "version"):
                raise TypeError("%s has no settable field %r" % (type(self).__name__, name))
            setattr(c, name, value)
        return c

    def __setattr__(self, name, value):
        types = _FIELD_TYPES.get(type(self))
        if types is None:
            types = _FIELD_TYPES[type(self)] = dict((f[0], f[1]) for f in self._fields_)
        check_int_range(value, types.get(name), "%s.%s" % (type(self).__name__, name))
        super().__setattr__(name, value)

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % (f[0], getattr(self, f[0])) for f in self._fields_[2:]))


class RouteConfig(_Config):
    """epx_route_config_t; defaults of EPX_ROUTE_CONFIG_INIT."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("num_experts", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("score_fn", _enum),
        ("num_groups", ctypes.c_int32),
        ("topk_groups", ctypes.c_int32),
        ("renormalize", ctypes.c_int32),
        ("scaling_factor", ctypes.c_float),
        ("capacity_mode", ctypes.c_int32),
        ("capacity_factor", ctypes.c_float),
        ("min_capacity", ctypes.c_int32),
        ("queue_order", _enum),
        ("drop_policy", _enum),
        ("aux_loss_coeff", ctypes.c_float),
        ("z_loss_coeff", ctypes.c_float),
        ("nonfinite", _enum),
        ("device", _enum),
        ("stream", ctypes.c_void_p),
        ("capacity_arithmetic", _enum),
        ("capacity_factor_f64", ctypes.c_double),
        ("renormalize_after_drop", ctypes.c_int32),
        ("group_score_experts", ctypes.c_int32),
        ("aux_counts", _enum),
        ("aux_loss_sequences", ctypes.c_int32),
        ("aux_loss_expert_counts", ctypes.c_void_p),
        ("aux_loss_tokens", ctypes.c_double),
        ("random_seed", ctypes.c_uint64),
        ("token_mask", ctypes.c_void_p),
    ]
    _defaults = dict(num_experts=0, top_k=0, score_fn=ScoreFn.SOFTMAX, num_groups=0, topk_groups=0,
                     renormalize=1, scaling_factor=1.0, capacity_mode=0, capacity_factor=1.0,
                     min_capacity=0, queue_order=QueueOrder.BY_CHOICE,
                     drop_policy=DropPolicy.BY_POSITION, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                     nonfinite=Nonfinite.ERROR, device=Device.CPU, stream=None,
                     capacity_arithmetic=CapacityArithmetic.FLOAT32, capacity_factor_f64=0.0,
                     renormalize_after_drop=0, group_score_experts=0,
                     aux_counts=AuxCounts.SELECTED, aux_loss_sequences=0,
                     aux_loss_expert_counts=None, aux_loss_tokens=0.0, random_seed=0,
                     token_mask=None)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "capacity_factor":
            # The factor is a Python float, a double, as DeepSpeed's is: the
            # library forms factor * K from capacity_factor_f64 (the float32
            # field alone rounds first, and K = 3 then differs), so setting
            # capacity_factor sets both.
            super().__setattr__("capacity_factor_f64", float(value))


class RouteOutput(ctypes.Structure):
    """epx_route_output_t (the caller owns every array)."""
    _fields_ = [
        ("topk_idx", ctypes.c_void_p),
        ("topk_w", ctypes.c_void_p),
        ("locations", ctypes.c_void_p),
        ("expert_counts", ctypes.c_void_p),
        ("aux_loss", ctypes.c_void_p),
        ("z_loss", ctypes.c_void_p),
        ("capacity", ctypes.c_int32),
        ("nonfinite_tokens", ctypes.c_int64),
    ]


class CommConfig(_Config):
    """epx_comm_config_t; defaults of EPX_COMM_CONFIG_INIT."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("timeout_seconds", ctypes.c_double),
        ("ranks_per_node", ctypes.c_int32),
    ]
    _defaults = dict(timeout_seconds=60.0, ranks_per_node=0)


class BufferConfig(_Config):
    """epx_buffer_config_t; defaults of EPX_BUFFER_CONFIG_INIT."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("device", _enum),
        ("dtype", _enum),
        ("hidden", ctypes.c_int64),
        ("num_experts", ctypes.c_int32),
        ("max_top_k", ctypes.c_int32),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("max_tokens_rounding", ctypes.c_int32),
        ("exchange", _enum),
        ("layout", _enum),
        ("expert_alignment", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("worst_case_sizing", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("combine_precision", _enum),
        ("exchange_path", _enum),
        ("sm_budget", ctypes.c_int32),
        ("fp8_format", _enum),
        ("low_latency", ctypes.c_int32),
        ("placement", ctypes.c_void_p),  # const epx_placement_t *; epx.Buffer(placement=) sets it
    ]
    _defaults = dict(device=Device.CPU, dtype=DType.FLOAT32, hidden=0, num_experts=0, max_top_k=0,
                     max_tokens_per_rank=0, max_tokens_rounding=256, exchange=Exchange.AUTO,
                     layout=Layout.EXPERT_MAJOR, expert_alignment=1, capacity=0,
                     worst_case_sizing=0, stream=None,
                     combine_precision=CombinePrecision.PARTIALS_FLOAT32,
                     exchange_path=ExchangePath.AUTO, sm_budget=0, fp8_format=FP8Format.NONE,
                     low_latency=0, placement=None)

    def __setattr__(self, name, value):
        if name == "placement" and value is not None and not isinstance(value, int):
            refuse_invalid("BufferConfig.placement is a %s; pass an epx.Placement as "
                           "Buffer(comm, config, placement=...), which keeps its arrays alive "
                           "(the field holds the address of an epx_placement_t)",
                           type(value).__name__)
        super().__setattr__(name, value)


class PlacementStruct(ctypes.Structure):
    """epx_placement_t (the arrays are the caller's; epx.Placement keeps them)."""
    _fields_ = [
        ("num_physical", ctypes.c_int32),
        ("physical_to_logical", ctypes.c_void_p),
        ("physical_rank", ctypes.c_void_p),
        ("replica_rule", _enum),
    ]


class Routing(ctypes.Structure):
    """epx_routing_t."""
    _fields_ = [
        ("num_tokens", ctypes.c_int64),
        ("top_k", ctypes.c_int32),
        ("topk_idx", ctypes.c_void_p),
        ("topk_w", ctypes.c_void_p),
        ("locations", ctypes.c_void_p),
        ("weighting", _enum),
    ]


class HandleStatsStruct(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in
                ("send_rows", "recv_rows", "send_bytes", "recv_bytes", "local_rows")]


class HandleTrafficStruct(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in
                ("same_node_rows", "same_node_bytes", "other_node_rows", "other_node_bytes")]


class RecorderStatsStruct(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in
                ("records", "replays", "fallbacks", "bytes_held", "bytes_avoided")]


# ---------------------------------------------------------------------------
# Prototypes
# ---------------------------------------------------------------------------

_st = ctypes.c_int
_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_i32, _i64, _f32, _f64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_double
_pi32 = ctypes.POINTER(ctypes.c_int32)
_pi64 = ctypes.POINTER(ctypes.c_int64)
_size = ctypes.c_size_t

_PROTOTYPES = {
    "epx_status_string": (ctypes.c_char_p, [_st]),
    "epx_last_error": (ctypes.c_char_p, []),
    "epx_dtype_size": (ctypes.c_size_t, [_enum]),
    "epx_convert": (_st, [_enum, _p, _enum, _p, _i64]),
    "epx_has_cuda": (ctypes.c_int, []),
    "epx_has_mpi": (ctypes.c_int, []),
    "epx_version": (ctypes.c_int32, []),
    "epx_route_config_init": (_st, [ctypes.POINTER(RouteConfig), _size]),
    "epx_comm_config_init": (_st, [ctypes.POINTER(CommConfig), _size]),
    "epx_buffer_config_init": (_st, [ctypes.POINTER(BufferConfig), _size]),
    "epx_route": (_st, [ctypes.POINTER(RouteConfig), _i64, _p, _p, ctypes.POINTER(RouteOutput)]),
    "epx_route_backward": (_st, [ctypes.POINTER(RouteConfig), _i64, _p, _p, _p, _p, _f32, _f32,
                                 _p]),
    "epx_route_agree_capacity": (_st, [_p, _i32, _p, _pi32]),
    "epx_route_capacity_of": (_st, [ctypes.POINTER(RouteConfig), _i64, _pi32]),
    "epx_route_sum_counts": (_st, [_p, _i32, _p, _p]),
    "epx_comm_create_self": (_st, [_pp]),
    "epx_local_world_create": (_st, [_i32, ctypes.POINTER(CommConfig), _pp]),
    "epx_local_world_destroy": (_st, [_p]),
    "epx_comm_create_local": (_st, [_p, _i32, _pp]),
    "epx_comm_create_mpi": (_st, [_p, ctypes.POINTER(CommConfig), _pp]),
    "epx_comm_create_shm": (_st, [ctypes.c_char_p, _i32, _i32, ctypes.POINTER(CommConfig), _pp]),
    "epx_comm_destroy": (_st, [_p]),
    "epx_comm_rank": (_st, [_p, _pi32]),
    "epx_comm_size": (_st, [_p, _pi32]),
    "epx_comm_topology": (_st, [_p, _pi32, _pi32, _pi32, _pi32]),
    "epx_comm_barrier": (_st, [_p]),
    "epx_comm_allgather": (_st, [_p, _p, _p, _size]),
    "epx_comm_shrink": (_st, [_p, ctypes.POINTER(CommConfig), _pp, _p, _pi32]),
    "epx_buffer_create": (_st, [_p, ctypes.POINTER(BufferConfig), _pp]),
    "epx_buffer_destroy": (_st, [_p]),
    "epx_buffer_max_tokens": (_st, [_p, _pi64]),
    "epx_buffer_max_recv_rows": (_st, [_p, _pi64]),
    "epx_buffer_set_stream": (_st, [_p, _p]),
    "epx_buffer_peer_paths": (_st, [_p, _pi32]),
    "epx_dispatch_layout": (_st, [_p, ctypes.POINTER(Routing), _p, _pp]),
    "epx_dispatch": (_st, [_p, _p, _p, _p, _i64]),
    "epx_dispatch_fp8": (_st, [_p, _p, _p, _p, _p, _p, _i64]),
    "epx_dispatch_quantize": (_st, [_p, _p, _p, _p, _p, _i64]),
    "epx_fp8_scale_shape": (_st, [_enum, _i64, _pi64, ctypes.POINTER(_size)]),
    "epx_quantize": (_st, [_enum, _enum, _i64, _i64, _p, _p, _p]),
    "epx_dequantize": (_st, [_enum, _enum, _i64, _i64, _p, _p, _p]),
    "epx_combine": (_st, [_p, _p, _p, _p]),
    "epx_ll_dispatch": (_st, [_p, ctypes.POINTER(Routing), _p, _p, _p, _p, _pp]),
    "epx_ll_dispatch_send": (_st, [_p, ctypes.POINTER(Routing), _p, _p, _p, _p, _pp]),
    "epx_ll_combine": (_st, [_p, _p, _p, _p]),
    "epx_ll_combine_send": (_st, [_p, _p, _p, _p]),
    "epx_ll_complete": (_st, [_p, _p]),
    "epx_ll_mask_rank": (_st, [_p, _i32, _i32]),
    "epx_ll_query_mask": (_st, [_p, ctypes.POINTER(_i32)]),
    "epx_ll_clean_mask": (_st, [_p]),
    "epx_ll_dispatch_fp8": (_st, [_p, ctypes.POINTER(Routing), _p, _p, _p, _p, _p, _p, _pp]),
    "epx_ll_dispatch_fp8_send": (_st, [_p, ctypes.POINTER(Routing), _p, _p, _p, _p, _p, _p, _pp]),
    "epx_dispatch_backward": (_st, [_p, _p, _p, _p, _p, _p]),
    "epx_combine_backward": (_st, [_p, _p, _p, _p, _p, _p]),
    "epx_weights_backward": (_st, [_p, _p, _p, _p]),
    "epx_handle_recv_rows": (_st, [_p, _pi64]),
    "epx_handle_recv_rows_device": (_st, [_p, _pp]),
    "epx_handle_expert_counts": (_st, [_p, _p, _p]),
    "epx_handle_recv_routing": (_st, [_p, _p, _p]),
    "epx_handle_recv_source": (_st, [_p, _p, _p]),
    "epx_handle_stats": (_st, [_p, ctypes.POINTER(HandleStatsStruct)]),
    "epx_handle_traffic": (_st, [_p, ctypes.POINTER(HandleTrafficStruct)]),
    "epx_handle_retain": (_st, [_p]),
    "epx_handle_release": (_st, [_p]),
    "epx_buffer_expert_load": (_st, [_p, _p, _i32]),
    "epx_placement_plan": (_st, [_p, _i32, _i32, _i32, _i32, _i32, _p]),
    "epx_placement_rank_load": (_st, [ctypes.POINTER(PlacementStruct), _i32, _i32, _p, _p]),
    "epx_replica_grad_sum": (_st, [_p, _p, _i64]),
    "epx_placement_move": (_st, [_p, _i32, ctypes.POINTER(PlacementStruct),
                                 ctypes.POINTER(PlacementStruct), _size, _p, _p]),
    "epx_placement_shrink": (_st, [ctypes.POINTER(PlacementStruct), _i32, _i32, _p, _i32, _p, _i32, _i32,
                                   _p, _p, _p, _pi32]),
    "epx_recorder_create": (_st, [_i32, _pp]),
    "epx_recorder_set_mode": (_st, [_p, _enum]),
    "epx_recorder_stats": (_st, [_p, ctypes.POINTER(RecorderStatsStruct)]),
    "epx_recorder_destroy": (_st, [_p]),
    "epx_reference_dense_dispatch": (_st, [_enum, _i64, _i64, _i32, _i32, _i32, _p, _p, _p, _enum,
                                           _p, _p]),
    "epx_reference_dense_combine": (_st, [_enum, _i64, _i64, _i32, _i32, _i32, _p, _p, _p, _enum,
                                          _p, _p]),
    "epx_reference_route": (_st, [ctypes.POINTER(RouteConfig), _i64, _p, _p, _p, _p, _p, _p, _p,
                                  _p, _pi32]),
    "epx_reference_route_backward": (_st, [ctypes.POINTER(RouteConfig), _i64, _p, _p, _p, _p,
                                           _f64, _f64, _p]),
}


class NcclUniqueId(ctypes.Structure):
    """epx_nccl_unique_id_t: the bytes of an ncclUniqueId."""
    _fields_ = [("bytes", ctypes.c_char * 128)]


# Calls a libepx may predate (built before the NCCL transport): bound when
# present, else replaced by a stand-in with the C contract for a build
# without NCCL (0 / EPX_ERROR_UNSUPPORTED).
_OPTIONAL = {
    "epx_has_nccl": (ctypes.c_int, [], 0),
    "epx_nccl_get_unique_id": (_st, [ctypes.POINTER(NcclUniqueId)], Status.ERROR_UNSUPPORTED),
    "epx_comm_create_nccl_id": (_st, [ctypes.POINTER(NcclUniqueId), _i32, _i32,
                                      ctypes.POINTER(CommConfig), _pp], Status.ERROR_UNSUPPORTED),
    "epx_comm_create_nccl": (_st, [_p, ctypes.POINTER(CommConfig), _pp], Status.ERROR_UNSUPPORTED),
    "epx_comm_create_nccl_mpi": (_st, [_p, ctypes.POINTER(CommConfig), _pp],
                                 Status.ERROR_UNSUPPORTED),
}


class _Missing:
    """Stands for a C function this libepx lacks."""

    def __init__(self, name, result):
        self.__name__ = name
        self.result = int(result)

    def __call__(self, *args):
        return self.result


class _RangeChecked:
    """A C function whose integer arguments are range-checked before the
    call (ctypes would wrap them): the net under the binding's own checks,
    which name the argument; this one names its position."""

    def __init__(self, name, fn, argtypes):
        self.__name__ = name
        self._fn = fn
        self._ints = [(i, t) for i, t in enumerate(argtypes) if t in (_i32, _i64)]

    def __call__(self, *args):
        for i, t in self._ints:
            if i < len(args) and _out_of_range(args[i], t) is not None:
                check_int_range(args[i], t, "%s: argument %d" % (self.__name__, i + 1))
        return self._fn(*args)


for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes
    setattr(lib, _name, _RangeChecked(_name, _fn, _argtypes))
for _name, (_restype, _argtypes, _absent) in _OPTIONAL.items():
    try:
        _fn = getattr(lib, _name)
    except AttributeError:
        setattr(lib, _name, _Missing(_name, _absent))
        continue
    _fn.restype = _restype
    _fn.argtypes = _argtypes
    setattr(lib, _name, _RangeChecked(_name, _fn, _argtypes))
