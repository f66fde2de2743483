"""epx in place of DeepEP for NeMo Automodel's MoE token dispatcher, on
:mod:`epx.deep_ep` (one implementation of DeepEP's semantics).

:func:`fused_dispatch` and :func:`fused_combine` have the signature and
return tuple of ``nemo_automodel.components.moe.megatron.fused_a2a``'s,
and are what that module does with a DeepEP ``Buffer``, on
``epx.deep_ep.Buffer``::

    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = fused_dispatch(
        x, token_indices, token_probs, num_experts, group)
    out, _ = fused_combine(expert_out, group, handle)

- ``recv_x [N, H]``: a row per (source rank, source token) that chose at
  least one of this rank's experts, by source rank then token (a token sent
  once per rank);
- ``recv_indices [N, K]`` int64: the row's experts as local ids, -1 for
  experts on other ranks; ``recv_probs [N, K]`` float32 their weights (0
  elsewhere), differentiable;
- ``tokens_per_expert [E_local]`` int64 on the CPU;
- ``fused_combine`` sums each token's rows from every rank (the expert
  applies the weights, as with DeepEP).

Both are differentiable as NeMo's are: dispatch's backward is a combine
that also sums the probs' gradient (taken where the row holds the expert:
elsewhere the received prob is a constant 0), combine's a dispatch on the
handle. Under NeMo's dispatch-replay recorder (its activation-checkpoint
context) a recompute's dispatch replays the forward's handle, as fused_a2a
does. ``async_finish`` and ``allocate_on_comm_stream`` are accepted; epx
runs on the current stream. ``group`` is a torch.distributed group or an
``epx.Comm`` (threads of epx.run_local, MPI); the epx comm is made once per
group, at its first call, and handed to the group's ``epx.deep_ep.Buffer``
(so the probs' gradient, [T, K] float32, moves with ``Comm.alltoallv``).

In NeMo Automodel, ``epx.deep_ep.install()`` before NeMo is imported makes
fused_a2a's own functions run on epx; ``epx.nemo.install()`` points them at
these instead, for a NeMo already imported::

    import epx.nemo
    epx.nemo.install()     # the DeepEP backend ("deepep") now runs on epx

Buffers grow with the largest dispatch of the group's ranks;
``configure(max_tokens_per_rank=...)`` sizes them for at least that many.
"""
import sys
import threading

import torch

import epx as _epx
from epx import Exchange, Status
from epx import _dropin
from epx import deep_ep as _deep_ep

__all__ = ["fused_dispatch", "fused_combine", "set_deepep_num_sms", "configure", "install",
           "close"]

_lock = threading.Lock()
_groups = {}    # id(group) -> (group, epx.Comm, epx.deep_ep.Buffer)
_settings = {"max_tokens_per_rank": 0, "timeout_seconds": None}


def configure(max_tokens_per_rank=None, timeout_seconds=None, exchange=None):
    """Settings of the buffers and comms made from now on: the fewest
    tokens a buffer is sized for (it grows with the largest dispatch), the
    comms' timeout. exchange: epx.Exchange.DEDUP (a token sent once per
    rank, DeepEP's), the only one epx.deep_ep runs."""
    if exchange is not None and Exchange(exchange) != Exchange.DEDUP:
        _epx._refuse(Status.ERROR_UNSUPPORTED, "epx.nemo.configure: exchange %s; epx.nemo runs "
                     "on epx.deep_ep, whose exchange is DeepEP's (epx.Exchange.DEDUP)",
                     Exchange(exchange).name)
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank),
                        ("timeout_seconds", timeout_seconds)):
        if value is not None:
            _settings[name] = value


def set_deepep_num_sms(num_sms):
    """DeepEP's SM count (``Buffer.set_num_sms``): the CTAs of epx's fused
    CUDA kernels."""
    _deep_ep.Buffer.set_num_sms(int(num_sms))


def _buffer_of(group):
    """The group's epx.deep_ep.Buffer, over an epx comm of the group (made,
    collectively, at the group's first call)."""
    with _lock:
        entry = _groups.get(id(group))
    if entry is None:  # made outside the lock: a collective over the group
        if isinstance(group, _epx.Comm):
            comm = group
        else:
            comm = _dropin.comm_of(group, _settings["timeout_seconds"])
        buffer = _deep_ep.Buffer(comm, explicitly_destroy=True)
        with _lock:
            entry = _groups.setdefault(id(group), (group, comm, buffer))
    buffer = entry[2]
    buffer.runtime.min_tokens = int(_settings["max_tokens_per_rank"] or 0)
    return buffer


def _replay():
    """NeMo's dispatch-replay recorder, when fused_a2a is loaded and one is
    active: (recorder, mode) or (None, None)."""
    fa = sys.modules.get(_NEMO_MODULES[0])
    if fa is None or not hasattr(fa, "_active_recorder"):
        return None, None
    return fa._active_recorder(), fa._replay_mode()


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, buffer):
        recorder, mode = _replay()
        replayed = recorder.take() if recorder is not None and mode == "replay" else None
        if replayed is not None:
            handle, recv_indices, recv_probs, tokens_per_expert = replayed
            recv_x = buffer.dispatch(x, handle=handle)[0]
        else:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(token_indices,
                                                                            num_experts)
            recv_x, recv_indices, recv_probs, counts, handle, _ = buffer.dispatch(
                x, topk_idx=token_indices, topk_weights=token_probs,
                num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)
            tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
            if recorder is not None and mode == "record":
                recorder.record((handle, recv_indices, recv_probs, tokens_per_expert))
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(recv_indices)
        ctx.mark_non_differentiable(recv_indices, tokens_per_expert)
        # views: the handle holds recv_x and recv_probs themselves, and an
        # output holds this node, which holds the handle (a cycle that would
        # keep the epx buffer busy until the garbage collector ran)
        return (recv_x.view_as(recv_x), recv_indices, recv_probs.view_as(recv_probs),
                tokens_per_expert, handle)

    @staticmethod
    def backward(ctx, grad_x, _grad_indices, grad_probs, _grad_counts, _grad_handle):
        recv_indices, = ctx.saved_tensors
        if grad_probs is not None:
            grad_probs = torch.where(recv_indices >= 0, grad_probs.float(), 0.0)
        dx, dprobs, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle,
                                           topk_weights=grad_probs)
        return dx, None, dprobs, None, None


class _Combine(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        return buffer.combine(x, handle)[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0], None, None


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    """x [T, H], token_indices [T, K] (global expert ids, -1 = none),
    token_probs [T, K] float32 -> (recv_x [N, H], recv_indices [N, K] int64
    local ids, recv_probs [N, K] float32, tokens_per_expert [E_local] int64
    (CPU), handle). Collective over the group."""
    fn = "epx.nemo.fused_dispatch"
    if token_indices.dim() != 2 or x.dim() != 2 or token_indices.shape[0] != x.shape[0]:
        _epx._invalid("%s: x %s and token_indices %s; expected [T, H] and [T, K]", fn,
                      list(x.shape), list(token_indices.shape))
    if token_probs.dtype != torch.float32:
        _epx._invalid("%s: token_probs has dtype %s; pass float32 (as DeepEP)", fn,
                      token_probs.dtype)
    buffer = _buffer_of(group)
    if num_experts % buffer.group_size:
        _epx._invalid("%s: num_experts %d is not a multiple of the group's %d ranks", fn,
                      num_experts, buffer.group_size)
    return _Dispatch.apply(x.contiguous(), token_indices, token_probs, int(num_experts), buffer)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """x [N, H] (a row per row of the dispatch) -> (out [T, H], None): each
    token's rows summed over the ranks. Collective over the group."""
    return _Combine.apply(x, _buffer_of(group), handle), None


def close():
    """Destroys the buffers and closes the comms this module made. A comm
    still in use (a backward not run yet: BusyError) stays registered and the
    error is raised: call close() again once it is free."""
    with _lock:
        entries = list(_groups.items())
    failed = None
    for key, (group, comm, buffer) in entries:
        try:
            if buffer.runtime is not None:
                buffer.runtime.close(strict=True)
                buffer.destroy()
            if comm is not group:
                comm.close()
        except _epx.EpxError as e:
            failed = failed or e
            continue
        with _lock:
            _groups.pop(key, None)
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
