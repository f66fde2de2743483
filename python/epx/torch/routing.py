"""Routing as custom ops: epx::route and epx::route_backward with autograd,
and the functional route() over them."""
import collections
import ctypes
import threading
from typing import NamedTuple, Optional, Tuple

import torch as _torch
from torch import Tensor

from epx import Device, _lib
from epx._lib import lib
from epx import semantics
from epx.errors import _check, _invalid
from epx.routing import _route_config, _route_config_check
from .autograd import _autograd
from .profiling import _ranged
from .tensors import _check_device, _empties, _F32, _I32, _I64, _ptr, _tensor


# A route config travels to the ops as its id: the struct's bytes in hex (a
# str, which an op takes as an argument and torch.compile keeps as a
# constant). The id holds the whole config, so any op can rebuild it; the
# cache below only saves the decoding, and is bounded: a value that changes
# every step (an annealed aux_loss_coeff, the step's aux_loss_tokens) makes
# a new id every call, and an unbounded table grew by each.
_CONFIGS = collections.OrderedDict()  # id -> RouteConfig, least recently used first
_CONFIGS_KEPT = 256
_config_lock = threading.Lock()


def _config_id(config):
    return ctypes.string_at(ctypes.addressof(config), ctypes.sizeof(config)).hex()


def _config_of(config_id):
    """The RouteConfig of an id (from the cache, or decoded into it)."""
    with _config_lock:
        config = _CONFIGS.get(config_id)
        if config is not None:
            _CONFIGS.move_to_end(config_id)
            return config
        config = _lib.RouteConfig.from_buffer_copy(bytes.fromhex(config_id))
        _CONFIGS[config_id] = config
        if len(_CONFIGS) > _CONFIGS_KEPT:
            _CONFIGS.popitem(last=False)
        return config


def _route_config_on(config_id, device, token_mask=None, aux_counts=None):
    """The interned config on the tensors' device and current stream, its
    memory fields pointing at this call's token_mask / aux counts."""
    is_cuda = device.type == "cuda"
    stream = _torch.cuda.current_stream(device).cuda_stream if is_cuda else None
    return _config_of(config_id).copy(device=Device.CUDA if is_cuda else Device.CPU,
                                      stream=stream, token_mask=_ptr(token_mask),
                                      aux_loss_expert_counts=_ptr(aux_counts))


@_torch.library.custom_op("epx::route", mutates_args=())
@_ranged("epx::route")
def _route_op(logits: Tensor, bias: Optional[Tensor], token_mask: Optional[Tensor],
              aux_counts: Optional[Tensor], config_id: str
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    config = _route_config_on(config_id, logits.device, token_mask, aux_counts)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    dev = logits.device
    idx, loc = (_torch.empty((T, K), dtype=_I32, device=dev) for _ in range(2))
    w = _torch.empty((T, K), dtype=_F32, device=dev)
    counts = _torch.empty((E,), dtype=_I32, device=dev)
    aux, z = _torch.zeros((), dtype=_F32, device=dev), _torch.zeros((), dtype=_F32, device=dev)
    out = _lib.RouteOutput()
    out.topk_idx, out.topk_w, out.locations = _ptr(idx), _ptr(w), _ptr(loc)
    out.expert_counts, out.aux_loss, out.z_loss = _ptr(counts), aux.data_ptr(), z.data_ptr()
    _check(lib.epx_route(ctypes.byref(config), T, _ptr(logits), _ptr(bias),
                              ctypes.byref(out)))
    info = _torch.tensor([out.capacity, out.nonfinite_tokens], dtype=_I64)
    return idx, w, loc, counts, aux, z, info


@_route_op.register_fake
def _route_fake(logits, bias, token_mask, aux_counts, config_id):
    config = _config_of(config_id)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    return _empties(semantics.route_outputs(T, K, E), logits)


@_torch.library.custom_op("epx::route_backward", mutates_args=())
@_ranged("epx::route_backward")
def _route_backward_op(logits: Tensor, bias: Optional[Tensor], token_mask: Optional[Tensor],
                       aux_counts: Optional[Tensor], topk_idx: Tensor,
                       grad_topk_w: Optional[Tensor], grad_aux: Optional[Tensor],
                       grad_z: Optional[Tensor], config_id: str) -> Tensor:
    """d loss / d logits. epx_route_backward takes the losses' gradients as
    host floats; reading them would wait on the device, so the gradient is
    assembled from its linear parts instead: the weights' part, plus
    grad_aux (and grad_z) times the part of a unit loss gradient, with the
    scaling done on the device."""
    config = _route_config_on(config_id, logits.device, token_mask, aux_counts)
    T, E = logits.shape

    def part(gw, ga, gz):
        g = _torch.empty((T, E), dtype=_F32, device=logits.device)
        _check(lib.epx_route_backward(ctypes.byref(config), T, _ptr(logits), _ptr(bias),
                                           _ptr(topk_idx), _ptr(gw), ga, gz, _ptr(g)))
        return g

    grad = part(grad_topk_w, 0.0, 0.0)
    if grad_aux is not None and config.aux_loss_coeff != 0.0:
        grad += grad_aux.to(_F32) * part(None, 1.0, 0.0)
    if grad_z is not None and config.z_loss_coeff != 0.0:
        grad += grad_z.to(_F32) * part(None, 0.0, 1.0)
    return grad


@_route_backward_op.register_fake
def _route_backward_fake(logits, bias, token_mask, aux_counts, topk_idx, grad_topk_w, grad_aux,
                         grad_z, config_id):
    return _empties(semantics.route_backward_outputs(*logits.shape), logits)[0]


def _route_grads(ctx, s, pair, g_idx, g_w, g_loc, g_counts, g_aux, g_z, g_info):
    """topk_w's and the losses' gradients through route_backward to logits."""
    route_backward, = pair
    if g_w is not None:
        g_w = g_w.contiguous()
    return {"logits": route_backward(s.logits, s.bias, s.token_mask, s.aux_counts, s.topk_idx,
                                     g_w, g_aux, g_z, s.config_id)}


_autograd(_route_op, _route_grads)


class TorchRouteResult(NamedTuple):
    """What :func:`route` returns. topk_w, aux_loss and z_loss are
    differentiable with respect to the logits; capacity is an int and
    nonfinite_tokens a 0-d int64 CPU tensor (neither waits for the device)."""
    topk_idx: Tensor         # [T, K] int32 expert ids, best first; -1 = dropped
    topk_w: Tensor           # [T, K] float32
    locations: Tensor        # [T, K] int32 slot in the expert's queue (capacity mode)
    expert_counts: Tensor    # [E] int32 routes chosen per expert
    aux_loss: Tensor         # 0-d float32 (times aux_loss_coeff)
    z_loss: Tensor           # 0-d float32 (times z_loss_coeff)
    capacity: int            # C in capacity mode, 0 otherwise (an int, as epx.route's)
    nonfinite_tokens: Tensor  # 0-d int64 (CPU): tokens dropped for NaN/Inf logits


_MEMORY_FIELDS = ("token_mask", "aux_loss_expert_counts", "stream")


def _route_tensors(fn, T, E, dev, token_mask, aux_loss_expert_counts):
    """token_mask [T] (bool or uint8, nonzero = a real token) as uint8 and
    aux_loss_expert_counts [E] as float32, on the logits' device."""
    if token_mask is not None:
        if not isinstance(token_mask, _torch.Tensor) or token_mask.shape != (T,):
            _tensor(token_mask, fn, "token_mask", _torch.uint8, (T,), dev)
        _check_device(token_mask, fn, "token_mask", dev)
        token_mask = token_mask.detach().to(_torch.uint8).contiguous()
    if aux_loss_expert_counts is not None:
        # as the mask: checked by shape and device only (no data_ptr, which a
        # torch.compile trace's fake tensor does not have)
        if not isinstance(aux_loss_expert_counts, _torch.Tensor) or aux_loss_expert_counts.shape != (E,):
            _tensor(aux_loss_expert_counts, fn, "aux_loss_expert_counts", _F32, (E,), dev)
        _check_device(aux_loss_expert_counts, fn, "aux_loss_expert_counts", dev)
        aux_loss_expert_counts = aux_loss_expert_counts.detach().to(_F32).contiguous()
    return token_mask, aux_loss_expert_counts


def _route_fields_config(config, shape, fields, fn):
    """The config of a route call, its memory fields cleared (the op passes
    those as tensors; the interned config holds none)."""
    for name in _MEMORY_FIELDS:
        if name in fields:
            _invalid("%s: %s is memory, not a number: pass it as a tensor keyword (%s=...)"
                     " rather than a config field", fn, name,
                     name if name != "stream" else "the current torch stream is used;"
                     " stream")
    config = _route_config(config, shape, fields, fn)
    if config.token_mask or config.aux_loss_expert_counts:
        _invalid("%s: config.token_mask / aux_loss_expert_counts are set; pass them as "
                 "tensors (token_mask=..., aux_loss_expert_counts=...) instead", fn)
    return config.copy(device=Device.CPU, stream=None)


def route(logits, config=None, *, bias=None, token_mask=None, aux_loss_expert_counts=None,
          **fields):
    """Routes T tokens (epx_route) -> :class:`TorchRouteResult`,
    differentiable: backward runs epx_route_backward with the gradients of
    topk_w, aux_loss and z_loss. logits [T, E] float32 on the CPU, or on a GPU
    with a CUDA libepx. config is an epx.RouteConfig; keyword arguments set
    its fields (num_experts defaults to E), every routing option included;
    a capacity_factor (or capacity_factor_f64) keyword turns capacity mode
    on, as MoE(capacity_factor=) does. token_mask [T] (bool/uint8, 0 = padding: routes nowhere, in no loss) and
    aux_loss_expert_counts [E] (the global aux loss's counts; with the
    aux_loss_tokens field) are tensors on the logits' device. On CUDA the
    default nonfinite=Nonfinite.ERROR waits for the device once per call
    (the check's verdict); Nonfinite.DROP does not."""
    fn = "epx.torch.route"
    if not isinstance(logits, _torch.Tensor):
        _invalid("%s: logits is a %s; pass a float32 torch.Tensor [T, E]", fn,
                 type(logits).__name__)
    if logits.dim() != 2:
        _invalid("%s: logits has shape %s; pass [T, E], a row of E expert scores per token", fn,
                 list(logits.shape))
    config = _route_fields_config(config, tuple(logits.shape), fields, fn)
    dev = Device.CUDA if logits.device.type == "cuda" else Device.CPU
    E = int(config.num_experts)
    capacity = _route_capacity(config, logits.shape[0] if logits.dim() else 0)
    if (not isinstance(logits, _torch.Tensor) or logits.dtype != _F32 or logits.dim() != 2
            or (E > 0 and logits.shape[1] != E)):
        _tensor(logits, fn, "logits", _F32, (None, E if E > 0 else None), dev)
    _check_device(logits, fn, "logits", dev)
    if bias is not None:
        bias = _tensor(bias, fn, "bias", _F32, (E,), dev)
    mask, counts = _route_tensors(fn, logits.shape[0], E, dev, token_mask, aux_loss_expert_counts)
    outs = _torch.ops.epx.route(logits.contiguous(), bias, mask, counts, _config_id(config))
    idx, w, loc, counts, aux, z, info = outs
    return TorchRouteResult(idx, w, loc, counts, aux, z, capacity, info[1])


def _route_capacity(config, num_tokens):
    """C of config for num_tokens tokens, a host int (no device wait: it
    depends on the config and T only). The config is checked first, so a
    bad one (top_k=-1, renormalize_after_drop without renormalize) is
    refused in epx_route's words before any tensor is sized from it.
    Dropless configs leave T alone (a traced T stays symbolic)."""
    _route_config_check(config)
    cap = ctypes.c_int32(0)
    tokens = int(num_tokens) if config.capacity_mode else 0
    _check(lib.epx_route_capacity_of(ctypes.byref(config), tokens, ctypes.byref(cap)))
    return cap.value
