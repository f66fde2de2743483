"""Elastic expert parallelism for the torch layer (epx.h, "Expert placement
and replicas"; epx.placement): an MoE layer whose local experts are its
rank's physical experts under an :class:`epx.Placement`, and the three
steps of rebalancing it — measure (:func:`plan_placement`: the layer's
route counts summed over the ranks, planned), keep replicas equal in
training (:func:`replica_grad_sum`), and move the weights to a new
placement (:func:`move_experts`, :func:`move_expert_tensor` for optimizer
state).

A training step with replicas::

    layer = et.MoE(comm, H, F, E, K, max_tokens_per_rank=T, placement=placement)
    loss = (layer(x) * g).sum() + layer.aux_loss
    loss.backward()
    et.replica_grad_sum(layer)          # every replica of an expert: the same gradient
    optimizer.step()                    # so replicas stay equal
    ...
    new = et.plan_placement(layer, num_physical=E + R)   # every few hundred steps
    et.move_experts(layer, new)         # collective; then rebuild the optimizer state

Every call is collective over the layer's comm and works on CPU tensors (the
C calls work on host memory); a layer on CUDA is refused by name (a CUDA
buffer takes a placement, but these moves and sums of its weights are on
host memory in this version).
"""
import torch as _torch

import epx as _epx
from epx import Placement, Status
from epx.errors import _invalid, _refuse


def _host(fn, what, device):
    if _torch.device(device).type != "cpu":
        _refuse(Status.ERROR_UNSUPPORTED, "%s: %s is on %s; this version moves and sums expert "
                "weights in host memory (CPU tensors) only: copy them to the host, or use CPU "
                "tensors (a CUDA buffer takes a placement; the weights' move is host-side)", fn,
                what, device)


def _numpy(t):
    """A numpy view of a contiguous CPU tensor (bfloat16 as int16: bytes)."""
    try:
        return t.numpy()
    except TypeError:
        carrier = {1: _torch.uint8, 2: _torch.int16, 4: _torch.int32, 8: _torch.int64}
        return t.view(carrier[t.element_size()]).numpy()


def _layer_buffer(fn, module_or_buffer):
    """(buffer, the layer or None) of an MoE layer or an epx.Buffer."""
    if isinstance(module_or_buffer, _epx.Buffer):
        return module_or_buffer, None
    buffer = getattr(module_or_buffer, "buffer", None)
    if not isinstance(buffer, _epx.Buffer):
        _invalid("%s: module_or_buffer is a %s; pass an epx.torch.MoE (or a module with an "
                 "epx.Buffer as .buffer) or an epx.Buffer", fn, type(module_or_buffer).__name__)
    return buffer, module_or_buffer


def _expert_params(fn, layer, params):
    if params is not None:
        return list(params)
    if layer is None:
        _invalid("%s: params is None with a buffer; pass the expert parameters ([E_local, ...] "
                 "each)", fn)
    try:
        return [layer.w_gate_up, layer.w_down]
    except AttributeError:
        _invalid("%s: the module has no w_gate_up / w_down; pass params", fn)


def _replicated(placement):
    return placement is not None and placement.num_physical > placement.num_experts


def layer_placement(placement, num_experts, num_ranks):
    """The placement an MoE layer takes (None: the contiguous map), refused
    by name where a layer cannot serve it: its router names logical
    experts, so the rule must be ROUND_ROBIN."""
    fn = "epx.torch.MoE"
    if placement is None:
        if num_experts % num_ranks:
            _invalid("%s: num_experts %d is not a multiple of the comm's %d ranks; pass one that "
                     "is, or a placement", fn, num_experts, num_ranks)
        return None
    if not isinstance(placement, Placement):
        _invalid("%s: placement is a %s; pass an epx.Placement or None", fn,
                 type(placement).__name__)
    if placement.replica_rule != _epx.ReplicaRule.ROUND_ROBIN:
        _invalid("%s: placement.replica_rule is %s but the layer's router names logical experts; "
                 "use ReplicaRule.ROUND_ROBIN", fn, placement.replica_rule.name)
    placement._for(fn, "placement", num_experts, num_ranks)
    return placement


def local_logical(placement, num_experts, rank, num_ranks):
    """The logical expert of each of a rank's local experts, in slot order."""
    if placement is None:
        El = num_experts // num_ranks
        return list(range(rank * El, (rank + 1) * El))
    return [int(e) for e in placement.local_logical(rank, num_ranks)]


def replica_grad_sum(module_or_buffer, params=None):
    """Sums the gradients of each replicated expert over its replicas, in
    place (epx_replica_grad_sum, collective over the layer's comm): call it
    after backward and before the optimizer step, as DDP's all-reduce, so
    every replica of an expert takes the same step and replicas stay equal.
    The sum is the gradient the expert has under the contiguous map.

    module_or_buffer: an epx.torch.MoE (params default to its w_gate_up and
    w_down) or an epx.Buffer (pass params). params: tensors [E_local, ...]
    on the CPU, this rank's physical experts in slot order; a missing .grad
    counts as zeros (it is set). Gradients are summed in float32 (one
    collective for all params) and rounded back to their dtype, so replicas
    agree bit for bit. Nothing happens under a placement without replicas.

    A helper rather than a gradient hook on purpose: a hook fires after each
    backward's accumulation into .grad, so with gradient accumulation it
    would add the replicas' earlier sums again; call it once per optimizer
    step, after the last micro-batch's backward."""
    fn = "epx.torch.replica_grad_sum"
    buffer, layer = _layer_buffer(fn, module_or_buffer)
    params = _expert_params(fn, layer, params)
    El = buffer.experts_per_rank
    for i, p in enumerate(params):
        if not isinstance(p, _torch.Tensor):
            _invalid("%s: params[%d] is a %s; pass tensors [E_local, ...]", fn, i,
                     type(p).__name__)
        _host(fn, "params[%d]" % i, p.device)
        if p.dim() < 1 or p.shape[0] != El:
            _invalid("%s: params[%d] has shape %s; expected [%d, ...] (this rank's physical "
                     "experts)", fn, i, list(p.shape), El)
    if not _replicated(buffer.placement):
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = _torch.zeros_like(p)
        grads.append(p.grad)
    flat = _torch.cat([g.detach().reshape(El, -1).to(_torch.float32) for g in grads], dim=1)
    buffer.replica_grad_sum(flat.contiguous().numpy())
    start = 0
    with _torch.no_grad():
        for g in grads:
            n = g[0].numel() if El else 0
            g.copy_(flat[:, start:start + n].reshape(g.shape))
            start += n


def plan_placement(module_or_buffer, num_physical, num_nodes=1, num_groups=1, reset=True):
    """A placement for the layer's measured load (collective): this rank's
    route counts (Buffer.expert_load, zeroed when reset) summed over the
    comm's ranks, planned by :meth:`epx.Placement.plan` over num_physical
    physical experts. Every rank gets the same placement."""
    fn = "epx.torch.plan_placement"
    buffer, _ = _layer_buffer(fn, module_or_buffer)
    load = buffer.comm.allgather(buffer.expert_load(reset=reset)).sum(axis=0)
    return Placement.plan(load, num_physical, buffer.comm.size, num_nodes, num_groups)


def move_expert_tensor(comm, tensor, old, new, num_experts=None):
    """One tensor of expert blocks moved to a new placement (collective;
    :func:`epx.placement_move` on a CPU tensor): tensor [P_old / W, ...] of
    this rank's physical experts under `old` -> a new tensor [P_new / W,
    ...] under `new` (None: the contiguous map). For an optimizer's
    per-expert state (Adam's exp_avg, exp_avg_sq) beside the weights."""
    fn = "epx.torch.move_expert_tensor"
    if not isinstance(tensor, _torch.Tensor):
        _invalid("%s: tensor is a %s; pass a CPU tensor [P / W, ...]", fn,
                 type(tensor).__name__)
    _host(fn, "tensor", tensor.device)
    src = tensor.detach().contiguous()
    E = num_experts if num_experts is not None else getattr(old, "num_experts",
                                                            getattr(new, "num_experts", 0))
    rows = (new.num_physical if isinstance(new, Placement) else int(E)) // max(comm.size, 1)
    out = _torch.empty((rows,) + tuple(src.shape[1:]), dtype=src.dtype)
    _epx.placement_move(comm, _numpy(src), old, new, num_experts=num_experts, out=_numpy(out))
    return out


def move_experts(moe, new_placement):
    """Moves an MoE layer to a new placement (collective over its comm):
    a new buffer with `new_placement` (None: the contiguous map) replaces
    the layer's, and each expert parameter (w_gate_up, w_down) gets the
    weights of its new physical experts (epx_placement_move: from a replica
    on the same rank where there is one). The parameters stay the same
    objects (their .data is replaced; the shape changes with P / W) and
    their .grad is cleared; an optimizer's per-expert state is not moved:
    move it with :func:`move_expert_tensor` or rebuild the optimizer. The
    layer's last aux_loss (its autograd graph) is dropped. CPU layers only."""
    fn = "epx.torch.move_experts"
    old_buffer, layer = _layer_buffer(fn, moe)
    params = _expert_params(fn, layer, None)
    for name, p in (("w_gate_up", params[0]), ("w_down", params[1])):
        _host(fn, "the layer's %s" % name, p.device)
    comm, old = old_buffer.comm, old_buffer.placement
    new = layer_placement(new_placement, old_buffer.num_experts, comm.size)
    layer.aux_loss = None
    held = [h for h in list(old_buffer._handles) if h._autograd and not h.released]
    if held:
        _refuse(Status.ERROR_BUSY, "%s: %d handle(s) of the layer's buffer are held by an "
                "autograd graph whose backward has not run; run it (or drop those outputs) "
                "before moving the experts", fn, len(held))
    new_buffer = _epx.Buffer(comm, old_buffer.config.copy(placement=None), placement=new)
    try:
        moved = [move_expert_tensor(comm, p, old, new, num_experts=old_buffer.num_experts)
                 for p in params]
    except BaseException:
        new_buffer.close()
        raise
    with _torch.no_grad():
        for p, data in zip(params, moved):
            p.data = data.to(p.dtype)
            p.grad = None
    layer.buffer, layer._buffer_id = new_buffer, new_buffer.id
    layer.placement = new
    layer.num_local_experts = new_buffer.experts_per_rank
    old_buffer.close()
    return layer


# -- the framework drop-ins (epx.deepspeed, epx.megatron) ---------------------


def dropin_placement(fn, placement, num_experts, num_ranks, why):
    """The placement a drop-in takes (None: the contiguous map): as
    :func:`layer_placement`, and without replicas, which the framework's
    experts module cannot hold (`why` says so in its own terms)."""
    placement = layer_placement(placement, num_experts, num_ranks)
    if _replicated(placement):
        _refuse(Status.ERROR_UNSUPPORTED, "%s: the placement has %d physical experts for %d "
                "logical ones (replicas), but %s; pass a placement with num_physical == "
                "num_experts (a permutation of the experts over the ranks: "
                "epx.Placement.plan(load, num_experts, W) balances that way), or use "
                "epx.torch.MoE, which holds replicas", fn, placement.num_physical,
                placement.num_experts, why)
    return placement


def move_expert_modules(comm, experts, old, new, num_experts):
    """Moves the weights of a rank's local experts, each a module of the
    same structure in slot order (a framework's per-expert modules), from
    placement `old` to `new` (collective; None: the contiguous map; the
    same number of experts a rank): each parameter name's [E_local, ...]
    stack is moved by :func:`move_expert_tensor` and written back into the
    same parameter objects, their .grad cleared. An optimizer's per-expert
    state is not moved (move_expert_tensor, or rebuild the optimizer)."""
    fn = "epx.torch.move_expert_modules"
    experts = list(experts)
    rows = (new.num_physical if isinstance(new, Placement) else int(num_experts)) // max(comm.size, 1)
    if len(experts) != rows:
        _invalid("%s: %d local experts but the new placement gives this rank %d; a framework's "
                 "experts module keeps its size", fn, len(experts), rows)
    names = [n for n, _ in experts[0].named_parameters()] if experts else []
    for name in names:
        params = [dict(m.named_parameters())[name] for m in experts]
        for p in params:
            _host(fn, "expert parameter %s" % name, p.device)
        stacked = _torch.stack([p.detach() for p in params]).contiguous()
        moved = move_expert_tensor(comm, stacked, old, new, num_experts=num_experts)
        with _torch.no_grad():
            for p, row in zip(params, moved):
                p.data = row.to(p.dtype).clone()
                p.grad = None
