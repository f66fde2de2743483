"""epx for PyTorch: routing, dispatch and combine as custom ops with autograd,
an MoE layer, a Megatron-shaped token dispatcher, torch.distributed comms and
activation-checkpoint replay.

Every library call is a ``torch.library`` custom op (``torch.ops.epx.*``)
with a fake (meta) implementation, so ``torch.compile`` traces a whole layer
without graph breaks, and no op waits on the device from the host:

- receive tensors are sized for the buffer's worst case
  (``epx_buffer_max_recv_rows``; rows past the valid count are zeros), and the
  valid row count and per-expert counts stay tensors on the buffer's device
  (:meth:`Dispatched.recv_rows_host` / :meth:`Dispatched.counts_host` ask for
  host values); ``exact_size=True`` trades one host sync for receive tensors
  of exactly the received rows;
- the aux- and z-loss gradients reach the router as tensors.

A layer step by hand::

    import epx, epx.torch as et
    r = et.route(logits, top_k=2)                         # differentiable in topk_w, losses
    d = et.dispatch(buffer, x, r.topk_idx, r.topk_w)      # d.recv_x [N_max, H], by local expert
    expert_out = my_experts(d.recv_x, d.offsets)          # groups [offsets[e], offsets[e+1])
    out = et.combine(d, expert_out)                       # sum_k w[t,k] * expert_out(t,k)
    (out * grad).sum().backward()                         # x.grad, logits.grad (the router learns)

Where the routing weights are applied is the handle's weighting: in combine
(default: combine's backward gives their gradient), in dispatch, or by the
expert (Weighting.NONE): the expert multiplies by ``d.recv_w``, which is an
autograd output of dispatch whose backward is epx_weights_backward, so the
router learns whichever side applies the weights.

dispatch, combine and their backward passes are collective: every rank runs
the same graph. CUDA tensors need a libepx built with EPX_BUILD_CUDA; every
call runs on PyTorch's current stream, unless dispatch/combine are given
previous_event, async_finish or comm_stream (then on a communication stream,
returning an :class:`EventOverlap`, as DeepEP). Importing this module imports torch
first, so a libepx linked with NCCL binds to torch's NCCL.
"""
# The package's rooms, by concept (each opens with what it holds): tensors
# (dtype maps, argument checks), profiling (op ranges, stats), overlap
# (EventOverlap), handles (a handle between ops), checkpointing (the ambient
# recorder, checkpoint_context), routing, ops and fp8 (the custom ops with
# their fake functions and autograd), functional (dispatch, combine,
# make_buffer), low_latency, grouped_matmul, moe (the MoE layer), elastic
# (the layer under an epx.Placement: replicas' gradients, plans, moves), dispatcher
# (TokenDispatcher), launch (comms from process groups, launchers) and local
# (run_local: W ranks as threads, on the CPU or one GPU). Each
# op's output shapes and backward pairing are epx.semantics'.
import torch as _torch  # first: a libepx linked with NCCL binds to torch's NCCL

import epx as _epx  # noqa: F401
from epx import DType, Device, Exchange, Layout, Status, Weighting  # noqa: F401 (as before)
from .tensors import epx_dtype, torch_dtype
from .profiling import stats
from .overlap import current_event, EventOverlap
from .handles import keep_handles
from .checkpointing import checkpoint_context, RECORDER_AMBIENT, RECORDER_NONE
from .routing import route, TorchRouteResult
from . import ops  # noqa: F401 (registers its custom ops)
from .fp8 import dequantize
from .functional import combine, dispatch, Dispatched, make_buffer
from .low_latency import ll_combine, ll_dispatch, ll_recv_source
from .grouped_matmul import grouped_mm
from .moe import MoE
from .elastic import (move_expert_modules, move_expert_tensor, move_experts, plan_placement,
                      replica_grad_sum)
from .dispatcher import TokenDispatcher
from .launch import comm_from_process_group, init_process_group, launch_env
from .local import run_local

# Private names the tests read as epx.torch._NAME.
from .routing import _CONFIGS, _CONFIGS_KEPT  # noqa: F401
from .moe import _MOE_FIXED  # noqa: F401
from .launch import _MPI_LAUNCH_VARS, _LAUNCHERS  # noqa: F401

__all__ = ["route", "dispatch", "combine", "Dispatched", "TorchRouteResult", "MoE",
           "TokenDispatcher", "checkpoint_context", "keep_handles", "comm_from_process_group",
           "init_process_group", "launch_env", "run_local", "EventOverlap", "current_event", "stats",
           "make_buffer", "grouped_mm", "epx_dtype", "torch_dtype", "ll_dispatch", "ll_combine",
           "ll_recv_source", "dequantize", "replica_grad_sum", "plan_placement", "move_experts",
           "move_expert_tensor"]
