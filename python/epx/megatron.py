"""epx as Megatron-core's token dispatcher.

:class:`EpxTokenDispatcher` is a ``MoETokenDispatcher`` with Megatron's
six-method interface (``dispatch_preprocess``, ``token_dispatch``,
``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``,
``combine_postprocess``); its outputs are those of Megatron's
``MoEAlltoAllTokenDispatcher`` on the same routing: the permuted tokens in
the same order (by local expert, then source rank, then token), the same
``tokens_per_expert`` (int64, on the CPU), ``permuted_probs`` (which the
experts apply, as Megatron's do) and the same combined output. The exchange
across the expert-parallel group is epx's dispatch and combine; with expert
tensor parallelism the tokens are gathered over the expert-TP group as
Megatron does (all-gather after dispatch, reduce-scatter before combine).

Plug it into a built model (``MoELayer`` makes its own dispatcher from
``config.moe_token_dispatcher_type``; keep "alltoall" there)::

    import epx.megatron
    model = build_your_megatron_model(...)
    epx.megatron.install(model)            # every MoELayer now dispatches through epx

or one layer by hand: ``layer.token_dispatcher = EpxTokenDispatcher(
layer.num_local_experts, layer.local_expert_indices, config=layer.config,
pg_collection=pg_collection)``.

The epx comm of the expert-parallel group is made from the group (one rank:
a comm of its own; more: :func:`epx.torch.comm_from_process_group`) unless
``comm`` is given; its buffer is made at the first dispatch, sized for that
call's most tokens over the ranks, and grows (on every rank together) when a
larger batch comes, unless ``max_tokens_per_rank`` fixes its size. The host waits for
the device three times a step (Megatron's own dispatcher waits for its
counts too): the routing check before the exchange, and the received row
count and the counts after it (the experts take exact-size inputs and the
counts on the CPU).

On a machine without a GPU, build and run Megatron's MoE layer inside
:func:`cpu_shim` (Megatron's dispatcher makes a ``torch.cuda.Stream()``, its
router moves to the current CUDA device)::

    with epx.megatron.cpu_shim():
        layer = MoELayer(config, submodules, pg_collection=pgs)
        epx.megatron.install(layer)
        out, bias = layer(x)

A placement (``placement=``, an :class:`epx.Placement` with as many
physical experts as logical ones: Megatron's experts module holds
``num_moe_experts / expert_model_parallel_size`` experts a rank, so replicas
are refused by name) puts each logical expert on the rank it names, local
expert i of the layer's experts module serving
``placement.local_logical(rank)[i]``; ``install(model, placement=p)`` moves
the built model's experts there, and :func:`move_placement` moves a layer's
experts to a new placement mid-training (collective; the experts module a
``SequentialMLP``: the grouped-GEMM ones are refused by name)::

    new = epx.torch.plan_placement(layer.token_dispatcher, num_physical=E)
    epx.megatron.move_placement(layer, new)   # then rebuild the optimizer's state

Not supported (refused at construction, naming the setting):
``moe_pad_expert_input_to_capacity``, ``moe_router_padding_for_quantization``
and ``moe_shared_expert_overlap`` (the MoELayer then runs its shared experts
itself).
"""
import contextlib
import warnings
from types import SimpleNamespace

import torch

from megatron.core import utils as _mutils
from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

import epx as _epx
import epx.torch as _et
from epx import Exchange, Status
from epx import _dropin
from epx.torch.dispatcher import check_routing_map_rows, routing_map_topk

__all__ = ["EpxTokenDispatcher", "install", "move_placement", "cpu_shim"]

_NO_REPLICAS = ("Megatron's experts module holds num_moe_experts / expert_model_parallel_size "
                "experts a rank (fixed when the MoELayer is built)")

_UNSUPPORTED = (
    ("moe_pad_expert_input_to_capacity", "epx's expert-major layout is dropless here; capacity "
     "drops come from the router (moe_expert_capacity_factor without padding works)"),
    ("moe_router_padding_for_quantization", "the experts get exact-size groups"),
    ("moe_shared_expert_overlap", "set it False: the MoELayer then computes its shared experts "
     "itself"),
)


class _HostStream:
    """Stands in for the CUDA stream and event Megatron's all-to-all
    dispatcher copies its counts on: on the CPU every copy is already done."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _padded(t, rows):
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _uneven(all_gather, reduce_scatter):
    """gloo's all_gather and reduce_scatter take blocks of one size; NCCL's
    (which the expert-TP gather meets on GPUs) any: blocks padded to the
    largest."""
    def gather(tensor_list, tensor, group=None, async_op=False):
        rows = max(t.shape[0] for t in tensor_list)
        full = [_padded(t, rows) for t in tensor_list]
        all_gather(full, _padded(tensor, rows), group=group)
        for t, f in zip(tensor_list, full):
            t.copy_(f[:t.shape[0]])

    def scatter(output, input_list, group=None, async_op=False, **kw):
        rows = max(t.shape[0] for t in input_list)
        out = _padded(output, rows)
        reduce_scatter(out, [_padded(t, rows) for t in input_list], group=group, **kw)
        output.copy_(out[:output.shape[0]])
    return gather, scatter


@contextlib.contextmanager
def cpu_shim():
    """Megatron-core's MoE layer on a machine without a GPU, for the body
    of the ``with``: its CUDA stream calls stubbed out (the all-to-all
    dispatcher copies its counts on a side stream it makes with
    ``torch.cuda.Stream()``), the CPU as torch.cuda's current device (the
    router moves its weight there), the count copies as numpy arrays (as
    Megatron's GPU copy makes them), gloo's all_gather / reduce_scatter
    taking blocks of different sizes (expert tensor parallelism gathers
    those), and ``te_general_gemm`` defined (megatron-core 0.16 without
    Transformer Engine leaves it undefined). Process-wide patches of
    torch.cuda, torch.distributed and megatron, restored on exit: use it
    around CPU tests and tools, not beside GPU work in other threads."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as mtd
    cuda, dist = torch.cuda, torch.distributed
    saved = (cuda.current_stream, cuda.stream, cuda.current_device,
             mtd.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, mtd.maybe_move_tensor_to_cpu,
             dist.all_gather, dist.reduce_scatter)
    dist.all_gather, dist.reduce_scatter = _uneven(dist.all_gather, dist.reduce_scatter)
    stream = _HostStream()
    cuda.current_stream = lambda *a: stream
    cuda.stream = lambda s: contextlib.nullcontext()
    cuda.current_device = lambda: "cpu"
    mtd.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    mtd.maybe_move_tensor_to_cpu = lambda t, as_numpy=False, record_stream=False: (
        t.numpy() if as_numpy and torch.is_tensor(t) else t)
    moe_utils.__dict__.setdefault("te_general_gemm", None)
    try:
        yield
    finally:
        (cuda.current_stream, cuda.stream, cuda.current_device,
         mtd.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, mtd.maybe_move_tensor_to_cpu,
         dist.all_gather, dist.reduce_scatter) = saved


def _default_pg_collection():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    return get_default_pg_collection()


class EpxTokenDispatcher(MoETokenDispatcher):
    """Megatron's token dispatcher over epx (see the module's docstring).

    num_local_experts, local_expert_indices, config and pg_collection are
    those of Megatron's dispatchers (pg_collection None: Megatron's global
    parallel state). comm: an epx.Comm over the expert-parallel group (its
    rank order the group's); None makes one (closed by :meth:`close`).
    placement: an epx.Placement without replicas (local expert i serves
    placement.local_logical(ep rank)[i]; the weights are the caller's to
    put there: install and move_placement do) or None, the contiguous map.
    max_tokens_per_rank: the most tokens a step gives a rank (default None:
    the first step's most, grown on every rank together when a larger step
    comes). exchange: epx.Exchange.DEDUP (a token sent once per rank) or
    COLLECTIVE (once per expert)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *,
                 comm=None, max_tokens_per_rank=None, exchange=Exchange.DEDUP,
                 timeout_seconds=None, placement=None):
        if pg_collection is None:
            pg_collection = _default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        fn = "epx.megatron.EpxTokenDispatcher"
        for name, why in _UNSUPPORTED:
            if getattr(config, name, False):
                _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: config.%s is not supported (%s)",
                             fn, name, why)
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.top_k = config.moe_router_topk
        ep_rank = _mutils.get_pg_rank(self.ep_group)
        if (self.num_experts != num_local_experts * self.ep_size or self.local_expert_indices
                != list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))):
            _epx._invalid("%s: local_expert_indices %s are not rank %d's block of %d of the %d "
                          "experts; epx places expert e on expert-parallel rank e // %d, as "
                          "Megatron's MoELayer does", fn, self.local_expert_indices, ep_rank,
                          num_local_experts, self.num_experts, num_local_experts)
        self._own_comm = comm is None
        self.comm = _dropin.comm_of(self.ep_group, timeout_seconds) if comm is None else comm
        if (self.comm.rank, self.comm.size) != (ep_rank, self.ep_size):
            _epx._invalid("%s: comm is rank %d of %d but the expert-parallel group's rank %d of "
                          "%d; pass a comm over the same ranks in the same order", fn,
                          self.comm.rank, self.comm.size, ep_rank, self.ep_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.exchange = Exchange(exchange)
        self.placement = _et.elastic.dropin_placement(fn, placement, self.num_experts,
                                                      self.ep_size, _NO_REPLICAS)
        self._epx_buffers = _dropin.BufferCache(fn, "pass max_tokens_per_rank=%d (or more) to "
                                                "EpxTokenDispatcher or epx.megatron.install(), "
                                                "or leave it None (the buffer then grows)")
        self._step = None

    @classmethod
    def replacing(cls, dispatcher, **options):
        """An EpxTokenDispatcher for the layer of `dispatcher` (any of
        Megatron's), over the same process groups."""
        groups = SimpleNamespace(ep=dispatcher.ep_group, expt_tp=dispatcher.tp_group,
                                 tp_ep=dispatcher.tp_ep_group)
        return cls(dispatcher.num_local_experts, dispatcher.local_expert_indices,
                   dispatcher.config, groups, **options)

    def set_shared_experts(self, shared_experts):
        _epx._refuse(Status.ERROR_UNSUPPORTED, "epx.megatron.EpxTokenDispatcher: shared-expert "
                     "overlap is not supported; set config.moe_shared_expert_overlap=False (the "
                     "MoELayer computes its shared experts itself)")

    @property
    def buffer(self):
        """The epx buffer (made at the first dispatch; None before)."""
        return self._epx_buffers.only()

    def close(self):
        """Closes the buffer, and the comm when this dispatcher made it."""
        self._epx_buffers.close()
        if self._own_comm:
            self.comm.close()

    # -- dispatch -----------------------------------------------------------

    def dispatch_preprocess(self, tokens, routing_map, probs):
        """tokens [..., H], routing_map [T, E] bool, probs [T, E] -> (tokens
        [T, H], the selected probs [T, K]); local only (one host read: the
        check that no token chose more than top_k experts)."""
        fn = "epx.megatron.EpxTokenDispatcher.dispatch_preprocess"
        E = self.num_experts
        if routing_map.dtype != torch.bool or routing_map.dim() != 2 or routing_map.shape[1] != E:
            _epx._invalid("%s: routing_map is %s %s; expected a bool [T, %d] tensor", fn,
                          routing_map.dtype, list(routing_map.shape), E)
        if probs.shape != routing_map.shape:
            _epx._invalid("%s: probs has shape %s but routing_map %s; pass the router's [T, E] "
                          "probabilities", fn, list(probs.shape), list(routing_map.shape))
        self.hidden_shape = tokens.shape
        x = tokens.reshape(-1, tokens.shape[-1])
        if x.shape[0] != routing_map.shape[0]:
            _epx._invalid("%s: %d tokens but routing_map has %d rows", fn, x.shape[0],
                          routing_map.shape[0])
        check_routing_map_rows(fn, routing_map, self.top_k, ", more than config.moe_router_topk="
                               "%d (set it to %d or more, or fix the router)")
        self._topk_idx, w = routing_map_topk(routing_map, probs, self.top_k)
        self._probs_dtype = probs.dtype
        return x, w

    def token_dispatch(self, hidden_states, probs):
        """The exchange over the expert-parallel group (epx's dispatch, exact
        size) -> (received tokens [N, H], their probs [N])."""
        d = self._epx_buffers.dispatch(self.comm, hidden_states, self._topk_idx, probs,
                                       self.max_tokens_per_rank, num_experts=self.num_experts,
                                       max_top_k=self.top_k, exchange=self.exchange,
                                       expert_alignment=1, placement=self.placement)
        self._step = SimpleNamespace(d=d)
        return d.recv_x, d.recv_w

    def dispatch_postprocess(self, hidden_states, probs):
        """-> (tokens [N, H] by local expert, tokens_per_expert [E_local]
        int64 on the CPU, permuted_probs [N]); with expert tensor
        parallelism, every expert-TP rank's tokens, as Megatron's all-to-all
        dispatcher orders them."""
        step = self._step
        counts = step.d.counts.cpu()
        tokens, probs = hidden_states, probs.to(self._probs_dtype)
        if self.tp_size > 1:
            tokens, counts, probs = self._gather_tp(step, tokens, counts, probs)
        return tokens, counts, probs

    def _gather_tp(self, step, tokens, counts, probs):
        """All-gather over the expert-TP group, then sort the chunks
        [tp rank, local expert] to [local expert, tp rank]."""
        tp, El = self.tp_size, self.num_local_experts
        # The counts travel on the tokens' device (an NCCL group's).
        per_rank = step.d.counts.new_empty((tp * El,))
        torch.distributed.all_gather_into_tensor(per_rank, step.d.counts, group=self.tp_group)
        per_rank = per_rank.reshape(tp, El).cpu()
        step.tp_rows = per_rank.sum(dim=1).tolist()
        tokens = gather_from_sequence_parallel_region(tokens, group=self.tp_group,
                                                      output_split_sizes=step.tp_rows)
        probs = gather_from_sequence_parallel_region(probs, group=self.tp_group,
                                                     output_split_sizes=step.tp_rows)
        step.per_rank = per_rank
        chunks = torch.arange(tp * El)
        tokens, probs = sort_chunks_by_idxs(tokens, per_rank.ravel(),
                                            chunks.reshape(tp, El).T.ravel(), probs=probs)
        return tokens, per_rank.sum(dim=0), probs

    # -- combine ------------------------------------------------------------

    def combine_preprocess(self, hidden_states):
        """Expert output [N, H] -> this rank's rows (with expert tensor
        parallelism: unsorted, then reduce-scattered over the expert-TP
        group)."""
        if self.tp_size == 1:
            return hidden_states
        step, tp, El = self._step, self.tp_size, self.num_local_experts
        chunks = torch.arange(tp * El)
        hidden_states, _ = sort_chunks_by_idxs(hidden_states, step.per_rank.T.ravel(),
                                               chunks.reshape(El, tp).T.ravel())
        return reduce_scatter_to_sequence_parallel_region(
            hidden_states.to(self._probs_dtype), group=self.tp_group,
            input_split_sizes=step.tp_rows).to(hidden_states.dtype)

    def token_combine(self, hidden_states):
        """The exchange back (epx's combine: each token's rows summed) -> [T, H]."""
        step, self._step = self._step, None
        if step is None:
            _epx._invalid("epx.megatron.EpxTokenDispatcher.token_combine: no dispatch to "
                          "combine; call the dispatch methods first")
        return _et.combine(step.d, hidden_states)

    def combine_postprocess(self, hidden_states):
        """-> the output in the shape of the dispatched tokens."""
        return hidden_states.view(self.hidden_shape)


def _local_experts(fn, layer):
    """The per-expert modules of a MoELayer's experts (a SequentialMLP's),
    in slot order."""
    experts = getattr(getattr(layer, "experts", None), "local_experts", None)
    if experts is None:
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: the layer's experts module is a %s, whose "
                     "weights are not one module per expert; moving experts takes a "
                     "SequentialMLP (moe_grouped_gemm=False), or use epx.torch.MoE", fn,
                     type(getattr(layer, "experts", None)).__name__)
    return experts


def move_placement(layer, new_placement):
    """Moves a Megatron MoELayer whose dispatcher is an EpxTokenDispatcher to
    a new placement (collective over its expert-parallel group; None: the
    contiguous map): each local expert's weights are moved
    (epx.torch.move_expert_modules: epx_placement_move) and the dispatcher
    remakes its buffer with the new map at the next dispatch. The
    parameters stay the same objects, their .grad cleared; an optimizer's
    state is not moved. Call it between steps (after backward)."""
    fn = "epx.megatron.move_placement"
    disp = getattr(layer, "token_dispatcher", None)
    if not isinstance(disp, EpxTokenDispatcher):
        _epx._invalid("%s: the layer's token_dispatcher is a %s; install epx first "
                      "(epx.megatron.install)", fn, type(disp).__name__)
    new = _et.elastic.dropin_placement(fn, new_placement, disp.num_experts, disp.ep_size,
                                       _NO_REPLICAS)
    _et.elastic.move_expert_modules(disp.comm, _local_experts(fn, layer), disp.placement, new,
                                    disp.num_experts)
    disp._epx_buffers.close()
    disp._epx_buffers = _dropin.BufferCache(disp._epx_buffers.fn, disp._epx_buffers.fix)
    disp.placement = new


def install(module, **options):
    """Replaces the token dispatcher of every Megatron MoE layer inside
    `module` (itself included) by an :class:`EpxTokenDispatcher` over the
    same groups; the layers of one expert-parallel group share one epx comm
    unless options give `comm`. With options' `placement`, each layer's
    experts (built on the contiguous map) are moved there (collective, as
    :func:`move_placement`). Returns the new dispatchers; with none (no
    MoE layer with a dispatcher inside `module`: called before the model
    was built, or on a pipeline stage of dense layers only) a warning says
    so."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    comms = {}
    made = []
    for m in module.modules():
        if not isinstance(m, BaseMoELayer) or m.token_dispatcher is None:
            continue
        old = m.token_dispatcher
        opts = dict(options)
        if "comm" not in opts:
            key = id(old.ep_group)
            if key not in comms:
                comms[key] = _dropin.comm_of(old.ep_group, opts.get("timeout_seconds"))
            opts["comm"] = comms[key]
        placement = opts.pop("placement", None)
        m.token_dispatcher = EpxTokenDispatcher.replacing(old, **opts)
        if placement is not None:
            move_placement(m, placement)
        made.append(m.token_dispatcher)
    if not made:
        warnings.warn("epx.megatron.install: %s holds no Megatron MoE layer (a BaseMoELayer with "
                      "a token_dispatcher), so nothing dispatches through epx; call it on the "
                      "built model that holds the MoE layers" % type(module).__name__,
                      stacklevel=2)
    return made
