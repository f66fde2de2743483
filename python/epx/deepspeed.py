"""epx as DeepSpeed's MoE layer.

:class:`MoE` is ``deepspeed.moe.layer.MoE`` (a subclass: DeepSpeed's engine
finds it, ``set_deepspeed_parallelism`` gives it its expert-parallel group,
``use_residual`` works) with the same arguments and the same return,
``(output, l_aux, exp_counts)``; its gate (``deepspeed_moe.gate.wg``) and
experts (``deepspeed_moe.experts``, your ``expert`` copied
``num_experts / ep_size`` times, each parameter tagged ``allreduce = False``
and ``group_name = "ep_size_<ep_size>"`` for the expert-data-parallel
all-reduce) are DeepSpeed's own, so checkpoints load unchanged. Only the
exchange differs: epx routes the tokens (``epx.torch.route`` with DeepSpeed's
gating: top-1, top-2, top-k, capacity, drop order, gate renormalisation,
l_aux) and moves them with its dispatch and combine, dropless of padding::

    from epx.deepspeed import MoE          # was: from deepspeed.moe.layer import MoE
    moe = MoE(hidden_size, expert, num_experts=8, ep_size=2, k=2,
              top2_2nd_expert_sampling=False)
    out, l_aux, exp_counts = moe(x)

Each local expert gets its own tokens as one 2-D ``[n, hidden]`` tensor
(DeepSpeed gives it a ``[ep_size, 1, capacity, hidden]`` block padded with
zero rows): experts that act row by row, an MLP, compute the same.

A placement (``placement=``, an :class:`epx.Placement` with as many
physical experts as logical ones: DeepSpeed's experts module holds
``num_experts / ep_size`` experts a rank, so replicas are refused by name)
puts each logical expert on the rank the placement says, local expert i
being ``placement.local_logical(rank)[i]``; :meth:`MoE.move_placement`
moves the experts' weights to a new one mid-training (collective,
``epx.torch.move_expert_modules``)::

    new = epx.torch.plan_placement(moe.deepspeed_moe, num_physical=num_experts)
    moe.move_placement(new)                  # then rebuild the optimizer's state

Not reproduced, refused with the fix: the random gates
(``noisy_gate_policy`` "Jitter"/"RSample", ``top2_2nd_expert_sampling=True``
with k=2), ``used_token``, Tutel, expert tensor parallelism. ``use_rts=True``
(top-1 with drops) becomes epx's seeded random priority
(``epx.DropPolicy.BY_RANDOM_PRIORITY``, seed ``rts_seed``), not torch's random
stream. Top-1 with drops and ``use_rts=False`` keeps the routes DeepSpeed's
top1gating keeps (the C tokens ``torch.topk`` picks among an expert's tied
mask values, computed as it does), not epx's first-C rule.
"""
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from deepspeed.moe.sharded_moe import _capacity as _deepspeed_capacity
from deepspeed.utils import groups as _groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

import epx as _epx
import epx.torch as _et
from epx import AuxCounts, DropPolicy, Exchange, QueueOrder, Status, Weighting
from epx import _dropin

__all__ = ["MoE", "MOELayer"]


_NO_REPLICAS = ("DeepSpeed's experts module holds num_experts / ep_size experts a rank (its "
                "expert-data-parallel groups and the optimizer are built on that count)")


def _unsupported(fmt, *args):
    _epx._refuse(Status.ERROR_UNSUPPORTED, fmt, *args)


def _top1_keeps_by_topk(k, drop_tokens, use_rts):
    """Whether the gate is top1gating with drops and no random priority: it
    keeps the routes torch.topk picks among tied mask values, which epx's
    routing does not reproduce (it keeps the first C); the layer drops
    them itself (_top1_kept)."""
    return k == 1 and drop_tokens and not use_rts


def _top1_kept(topk_idx, num_experts, capacity_factor, min_capacity):
    """topk_idx [T, 1] (every route kept) with -1 where DeepSpeed's
    top1gating (use_rts=False) drops the route: its capacity, then per
    expert the C tokens torch.topk(mask1, k=C, dim=0) returns among the
    column's tied 0/1 values, computed as it computes them (same op, same
    device), so the kept set is the one DeepSpeed keeps."""
    T = topk_idx.shape[0]
    mask1 = F.one_hot(topk_idx[:, 0].long(), num_classes=num_experts)
    capacity = _deepspeed_capacity(mask1, torch.tensor(capacity_factor),
                                   torch.tensor(min_capacity))
    top = torch.topk(mask1, k=int(min(int(capacity), T)), dim=0)[1]
    kept = (mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)).sum(1, keepdim=True) > 0
    return torch.where(kept, topk_idx, torch.full_like(topk_idx, -1))


def _gate_options(k, capacity_factor, min_capacity, drop_tokens, use_rts, rts_seed):
    """The epx.RouteConfig fields of DeepSpeed's top1gating / top2gating /
    topkgating(drop_policy="probs") with these arguments; top-1 with drops
    by position routes dropless here (the layer drops as torch.topk does:
    _top1_kept)."""
    if _top1_keeps_by_topk(k, drop_tokens, use_rts):
        drop_tokens = False
    fields = dict(top_k=k, renormalize=int(k > 1), renormalize_after_drop=int(k > 1),
                  aux_loss_coeff=1.0, min_capacity=min_capacity,
                  aux_counts=AuxCounts.FIRST_CHOICE if k == 2 else AuxCounts.SELECTED,
                  queue_order=QueueOrder.BY_TOKEN if k > 2 else QueueOrder.BY_CHOICE)
    if not drop_tokens:
        return dict(fields, capacity_mode=0)
    policy = {1: DropPolicy.BY_RANDOM_PRIORITY if use_rts else DropPolicy.BY_POSITION,
              2: DropPolicy.BY_POSITION}.get(k, DropPolicy.BY_SCORE)
    return dict(fields, capacity_mode=1, capacity_factor_f64=float(capacity_factor),
                drop_policy=policy, random_seed=rts_seed)


class MOELayer(torch.nn.Module):
    """``deepspeed.moe.sharded_moe.MOELayer`` over epx: DeepSpeed's gate and
    experts modules, epx's routing and exchange. forward(x [..., H]) -> the
    output; ``l_aux`` and ``exp_counts`` (int64 [E], routes chosen per
    expert before the capacity drop) are kept as attributes, as DeepSpeed's
    are."""

    def __init__(self, gate, experts, ep_group_name, ep_size, num_local_experts, *,
                 use_rts=True, rts_seed=0, max_tokens_per_rank=None, exchange=Exchange.DEDUP,
                 timeout_seconds=None, placement=None):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group, self.ep_group_name = None, ep_group_name
        self.ep_size, self.num_local_experts = ep_size, num_local_experts
        self.num_experts = ep_size * num_local_experts
        self.use_rts, self.rts_seed = use_rts, rts_seed
        self.max_tokens_per_rank = max_tokens_per_rank
        self.exchange, self.timeout_seconds = Exchange(exchange), timeout_seconds
        self.comm = None
        self._epx_buffers = _dropin.BufferCache("epx.deepspeed.MoE", "pass max_tokens_per_rank=%d "
                                                "(or more) to epx.deepspeed.MoE, or leave it None "
                                                "(the buffer then grows)")
        self.l_aux = self.exp_counts = None
        self.route_config = None  # (the gate's settings, their epx.RouteConfig)
        self.placement = _et.elastic.dropin_placement("epx.deepspeed.MoE", placement,
                                                      self.num_experts, ep_size, _NO_REPLICAS)

    def move_placement(self, new_placement):
        """Moves the experts to a new placement (collective over the
        layer's comm; None: the contiguous map): the weights of each local
        expert module are moved (epx_placement_move) and the buffer is
        remade with the new map at the next forward. The parameters stay
        the same objects; their .grad is cleared; an optimizer's state is
        not moved. Call it between steps (after backward)."""
        fn = "epx.deepspeed.MoE.move_placement"
        new = _et.elastic.dropin_placement(fn, new_placement, self.num_experts, self.ep_size,
                                           _NO_REPLICAS)
        comm = self._comm_now()
        _et.elastic.move_expert_modules(comm, self.experts.deepspeed_experts, self.placement,
                                        new, self.num_experts)
        self._epx_buffers.close()
        self._epx_buffers = _dropin.BufferCache(self._epx_buffers.fn, self._epx_buffers.fix)
        self.placement = new

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _comm_now(self):
        if self.comm is None:
            if self.ep_group is None and self.ep_size > 1:
                _epx._invalid("epx.deepspeed.MoE: ep_size is %d but the layer has no expert-"
                              "parallel group yet; call moe.set_deepspeed_parallelism() (or "
                              "deepspeed.initialize, which does) before the first forward",
                              self.ep_size)
            self.comm = (_epx.Comm.create_self() if self.ep_group is None
                         else _dropin.comm_of(self.ep_group, self.timeout_seconds))
        return self.comm

    @property
    def buffer(self):
        """The epx buffer (made at the first forward; None before)."""
        return self._epx_buffers.only()

    def close(self):
        """Closes the buffer and the comm (made at the first forward)."""
        self._epx_buffers.close()
        if self.comm is not None:
            self.comm.close()
        self.comm = None

    def _route_config(self):
        """The epx.RouteConfig of the gate's current settings, built once per
        setting (training and eval differ in capacity factor) rather than
        field by field every step."""
        g = self.gate
        factor = g.capacity_factor if self.training else g.eval_capacity_factor
        key = (g.k, factor, g.min_capacity, g.drop_tokens, self.use_rts, self.rts_seed)
        if self.route_config is None or self.route_config[0] != key:
            self.route_config = key, _epx.RouteConfig(num_experts=self.num_experts,
                                                      **_gate_options(*key))
        return self.route_config[1]

    def _route(self, x):
        logits = F.linear(x.float(), self.gate.wg.weight.float())
        r = _et.route(logits, self._route_config())
        g = self.gate
        if _top1_keeps_by_topk(g.k, g.drop_tokens, self.use_rts):
            factor = g.capacity_factor if self.training else g.eval_capacity_factor
            r = r._replace(topk_idx=_top1_kept(r.topk_idx, self.num_experts, factor,
                                               g.min_capacity))
        return r

    def _run_experts(self, d):
        """Each local expert on its rows of the dispatch -> [N, H]. One split
        of recv_x rather than a slice per expert: a slice's backward writes
        its gradient into a zeroed [N, H] tensor and autograd adds them up,
        E_local full-size fills and adds a step; the split's backward is
        one concatenation."""
        outs = []
        for expert, rows in zip(self.experts.deepspeed_experts,
                                d.recv_x.split(d.counts_host())):
            out = expert(rows)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs)

    def forward(self, *input, **kwargs):
        x = input[0]
        if len(input) > 1 and input[1] is not None:
            _unsupported("epx.deepspeed.MoE: used_token is not supported; mask padding out of "
                         "the loss instead")
        if bwc_tensor_model_parallel_world_size(_groups.mpu) > 1:
            _unsupported("epx.deepspeed.MoE: tensor-parallel models (groups.mpu with more than "
                         "one rank) are not supported")
        x2 = x.reshape(-1, x.shape[-1])
        r = self._route(x2)
        d = self._epx_buffers.dispatch(self._comm_now(), x2, r.topk_idx, r.topk_w,
                                       self.max_tokens_per_rank, weighting=Weighting.IN_COMBINE,
                                       num_experts=self.num_experts, max_top_k=self.gate.k,
                                       exchange=self.exchange, expert_alignment=1,
                                       placement=self.placement)
        out = _et.combine(d, self._run_experts(d))
        self.l_aux, self.exp_counts = r.aux_loss, r.expert_counts.to(torch.int64)
        return out.reshape(x.shape)


class MoE(_DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with epx's exchange (see the module's
    docstring). The arguments are DeepSpeed's; the keyword-only ones are
    epx's: rts_seed (the seed of use_rts), max_tokens_per_rank (the most
    tokens a rank gives a forward; default None: sized by the first forward
    and grown, on every rank together, when a larger batch comes), exchange (epx.Exchange.DEDUP: a token sent
    once per rank; COLLECTIVE: once per expert), timeout_seconds."""

    def __init__(self, hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, use_residual=False,
                 noisy_gate_policy=None, drop_tokens=True, use_rts=True, use_tutel=False,
                 enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=True, *,
                 rts_seed=0, max_tokens_per_rank=None, exchange=Exchange.DEDUP,
                 timeout_seconds=None, placement=None):
        fn = "epx.deepspeed.MoE"
        if noisy_gate_policy not in (None, "None"):
            _unsupported("%s: noisy_gate_policy=%r is not supported; pass None", fn,
                         noisy_gate_policy)
        if k == 2 and top2_2nd_expert_sampling:
            _unsupported("%s: top2_2nd_expert_sampling=True (a Gumbel-sampled second expert) is "
                         "not supported; pass top2_2nd_expert_sampling=False (the second best "
                         "expert)", fn)
        if use_tutel or enable_expert_tensor_parallelism:
            _unsupported("%s: use_tutel and enable_expert_tensor_parallelism are not supported; "
                         "pass False", fn)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor,
                         eval_capacity_factor, min_capacity, use_residual, noisy_gate_policy,
                         drop_tokens, use_rts, use_tutel, enable_expert_tensor_parallelism,
                         top2_2nd_expert_sampling)
        ds = self.deepspeed_moe
        self.deepspeed_moe = MOELayer(ds.gate, ds.experts, ds.ep_group_name, ep_size,
                                      self.num_local_experts, use_rts=use_rts, rts_seed=rts_seed,
                                      max_tokens_per_rank=max_tokens_per_rank, exchange=exchange,
                                      timeout_seconds=timeout_seconds, placement=placement)

    def move_placement(self, new_placement):
        """Moves the experts to a new placement (:meth:`MOELayer.move_placement`)."""
        self.deepspeed_moe.move_placement(new_placement)

    def close(self):
        """Closes the layer's epx buffer and comm."""
        self.deepspeed_moe.close()
