"""epx in place of DeepEP for NeMo Automodel's MoE token dispatcher.

:func:`fused_dispatch` and :func:`fused_combine` have the signature and
return tuple of ``nemo_automodel.components.moe.megatron.fused_a2a``'s
(DeepEP's normal-mode dispatch and combine)::

    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = fused_dispatch(
        x, token_indices, token_probs, num_experts, group)
    out, _ = fused_combine(expert_out, group, handle)

- ``recv_x [N, H]``: a row per (source rank, source token) that chose at
  least one of this rank's experts, by source rank then token (epx's
  rank-major layout, a token sent once per rank);
- ``recv_indices [N, K]`` int64: the row's experts as local ids, -1 for
  experts on other ranks; ``recv_probs [N, K]`` float32 their weights (0
  elsewhere), differentiable;
- ``tokens_per_expert [E_local]`` int64 on the CPU;
- ``fused_combine`` sums each token's rows from every rank (the expert
  applies the weights, as with DeepEP).

Both are differentiable (dispatch's backward is a combine, combine's a
dispatch, as DeepEP's). ``async_finish`` and ``allocate_on_comm_stream`` are
accepted; epx runs on the current stream, so the results are ready in
stream order, as DeepEP's are after ``current_stream_wait``. ``group`` is a
torch.distributed group (its epx comm made once, at the first call: one
rank: a comm of its own; more: :func:`epx.torch.comm_from_process_group`)
or an ``epx.Comm``. The host waits for the received row count and the
counts once per dispatch, as DeepEP's normal mode waits for its counts.

In NeMo Automodel, before the model is built::

    import epx.nemo
    epx.nemo.install()     # the DeepEP backend ("deepep") now runs on epx

Buffers are made per (group, hidden, dtype, device, experts, top-k), sized
for the largest first call over the group's ranks and grown (on every rank
together) when a larger call comes, or fixed at
``configure(max_tokens_per_rank=...)``.
"""
import threading

import torch

import epx as _epx
import epx.torch as _et
from epx import Exchange, Layout, Status
from epx import _dropin

__all__ = ["fused_dispatch", "fused_combine", "set_deepep_num_sms", "configure", "install",
           "close"]

_lock = threading.Lock()
_comms = {}     # id(group) -> (group, epx.Comm)
_buffers = _dropin.BufferCache("epx.nemo.fused_dispatch", "call epx.nemo.close(), then "
                                "epx.nemo.configure(max_tokens_per_rank=%d) (or more; 0: the "
                                "buffers grow)")
_settings = {"max_tokens_per_rank": 0, "timeout_seconds": None, "sm_budget": 0,
             "exchange": Exchange.DEDUP}


def configure(max_tokens_per_rank=None, timeout_seconds=None, exchange=None):
    """Settings of the buffers and comms made from now on: the most tokens
    one dispatch gives (default 0: the largest first call of the group,
    grown on every rank together when a larger call comes), the
    comms' timeout, the exchange (epx.Exchange.DEDUP: a token sent once per
    rank, DeepEP's)."""
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank),
                        ("timeout_seconds", timeout_seconds), ("exchange", exchange)):
        if value is not None:
            _settings[name] = value


def set_deepep_num_sms(num_sms):
    """DeepEP's SM count: the CTAs of epx's fused CUDA kernels
    (BufferConfig.sm_budget) in the buffers made from now on."""
    _settings["sm_budget"] = int(num_sms)


def _comm_of(group):
    if isinstance(group, _epx.Comm):
        return group
    with _lock:
        entry = _comms.get(id(group))
    if entry is None:  # made outside the lock: a collective over the group
        comm = _dropin.comm_of(group, _settings["timeout_seconds"])
        with _lock:
            entry = _comms.setdefault(id(group), (group, comm))
    return entry[1]


def _dispatch(comm, x, token_indices, token_probs, num_experts):
    """The dispatch on the buffer of this shape (made collectively at its
    first call, grown as _dropin.BufferCache says)."""
    top_k = token_indices.shape[1]
    key = (id(comm), x.shape[1], x.dtype, x.device, num_experts, top_k)
    return _buffers.dispatch(comm, x, token_indices, token_probs,
                             _settings["max_tokens_per_rank"] or None, key,
                             num_experts=num_experts, max_top_k=top_k, layout=Layout.RANK_MAJOR,
                             exchange=_settings["exchange"], sm_budget=_settings["sm_budget"])


class Handle:
    """What fused_dispatch returns for fused_combine: the epx dispatch."""

    def __init__(self, dispatched, rows):
        self.dispatched, self.rows = dispatched, rows


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    """x [T, H], token_indices [T, K] (global expert ids, -1 = none),
    token_probs [T, K] float32 -> (recv_x [N, H], recv_indices [N, K] int64
    local ids, recv_probs [N, K] float32, tokens_per_expert [E_local] int64
    (CPU), handle). Collective over the group."""
    fn = "epx.nemo.fused_dispatch"
    comm = _comm_of(group)
    if token_indices.dim() != 2 or x.dim() != 2 or token_indices.shape[0] != x.shape[0]:
        _epx._invalid("%s: x %s and token_indices %s; expected [T, H] and [T, K]", fn,
                      list(x.shape), list(token_indices.shape))
    if num_experts % comm.size:
        _epx._invalid("%s: num_experts %d is not a multiple of the group's %d ranks", fn,
                      num_experts, comm.size)
    if token_probs.dtype != torch.float32:
        _epx._invalid("%s: token_probs has dtype %s; pass float32 (as DeepEP)", fn,
                      token_probs.dtype)
    d = _dispatch(comm, x.contiguous(), token_indices, token_probs, num_experts)
    first = comm.rank * (num_experts // comm.size)
    local = torch.where(d.recv_expert >= 0, d.recv_expert - first, -1).to(torch.int64)
    return d.recv_x, local, d.recv_w, d.counts.cpu(), Handle(d, d.recv_x.shape[0])


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """x [N, H] (a row per row of the dispatch) -> (out [T, H], None): each
    token's rows summed over the ranks. Collective over the group."""
    if not isinstance(handle, Handle):
        _epx._invalid("epx.nemo.fused_combine: handle is a %s; pass the handle "
                      "epx.nemo.fused_dispatch returned", type(handle).__name__)
    if x.shape[0] != handle.rows:
        _epx._invalid("epx.nemo.fused_combine: x has %d rows but the dispatch received %d",
                      x.shape[0], handle.rows)
    return _et.combine(handle.dispatched, x), None


def close():
    """Closes the buffers and the comms this module made. A buffer still in
    use (a backward not run yet: BusyError) stays registered, with the comms,
    and the error is raised: call close() again once it is free."""
    _buffers.close()
    with _lock:
        comms = list(_comms.items())
    failed = None
    for key, (_, c) in comms:
        try:
            c.close()
        except _epx.EpxError as e:
            failed = failed or e
        if not c.closed:
            continue
        with _lock:
            _comms.pop(key, None)
    if failed is not None:
        raise failed


_NEMO_MODULES = ("nemo_automodel.components.moe.megatron.fused_a2a",
                 "nemo_automodel.components.moe.megatron.token_dispatcher")


def install():
    """Points NeMo Automodel's DeepEP functions (fused_a2a's and the token
    dispatcher's imported names) at epx's. Call it before the model is
    built; its MoE layers then use the "deepep" backend without DeepEP."""
    import importlib
    try:
        modules = [importlib.import_module(name) for name in _NEMO_MODULES]
    except ImportError as e:
        _epx._refuse(Status.ERROR_UNSUPPORTED, "epx.nemo.install: NeMo Automodel's MoE "
                     "modules do not import (%s); install nemo_automodel", e)
    for m in modules:
        m.fused_dispatch, m.fused_combine = fused_dispatch, fused_combine
        if hasattr(m, "set_deepep_num_sms"):
            m.set_deepep_num_sms = set_deepep_num_sms
    return modules
