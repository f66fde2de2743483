"""Routing over numpy arrays: route and route_backward (epx_route, its
backward), their references, RouteResult, and the capacity helpers
(route_capacity, route_agree_capacity, route_sum_counts)."""
import ctypes
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _lib
from ._lib import Device, lib, RouteConfig, Status
from .arrays import asarray, empty, _F32, _I32, _ptr
from .errors import _c_int, _check, _invalid, _refuse


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


def _capacity_keyword(fields, fn):
    """A capacity factor given as a keyword turns capacity mode on, as
    MoE(capacity_factor=) does (the factor alone would be ignored in the
    default dropless mode); with capacity_mode=0 beside it, it is refused."""
    named = [f for f in ("capacity_factor", "capacity_factor_f64") if f in fields]
    if not named:
        return fields
    if "capacity_mode" not in fields:
        return dict(fields, capacity_mode=1)
    if not fields["capacity_mode"]:
        _invalid("%s: %s=%r with capacity_mode=0: the factor applies in capacity mode only; "
                 "leave capacity_mode out (a capacity factor turns it on) or drop %s", fn,
                 named[0], fields[named[0]], named[0])
    return fields


def _route_config(config, logits_shape, fields, fn="epx.route"):
    fields = _capacity_keyword(fields, fn)
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
    config = _route_config(config, np.shape(logits), fields, fn)
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
    aux_counts, aux_loss_sequences, aux_loss_tokens, random_seed, ...); a
    capacity_factor keyword turns capacity mode on.
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
    config = _route_config(config, np.shape(logits), fields, fn)
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
    min_capacity; 0 in dropless mode (a capacity_factor keyword turns
    capacity mode on, as in route). E.g. the capacity of a buffer sized
    for max_tokens_per_rank."""
    config = _route_config(config, (), fields, "epx.route_capacity")
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
