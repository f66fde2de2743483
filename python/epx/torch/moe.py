"""The MoE layer: router, experts and epx's exchange as one nn.Module."""
import math

import torch as _torch
import torch.nn.functional as _F
from torch import Tensor

import epx as _epx
from epx import Device, Exchange, Layout, Status, Weighting
from epx.errors import _invalid, _refuse
from .checkpointing import RECORDER_AMBIENT
from .elastic import layer_placement, local_logical
from .fp8 import _Fp8StraightThrough
from .functional import combine, Dispatched, make_buffer
from .grouped_matmul import grouped_mm
from .routing import _config_id, _route_capacity, _route_tensors
from .tensors import _F32, _I32, torch_dtype


_MOE_FIXED = ("num_experts", "top_k", "capacity_mode", "device", "stream", "token_mask",
              "aux_loss_expert_counts")


def _moe_route_config(num_experts, top_k, capacity_factor, on_gpu, route_config, options):
    """The MoE router's RouteConfig: route_config (or the defaults) with
    the keyword routing options set; capacity mode when capacity_factor is
    given (into capacity_factor_f64 under CapacityArithmetic.FLOAT64)."""
    fn = "epx.torch.MoE"
    for name in _MOE_FIXED:
        if name in options:
            _invalid("%s: %s is not a routing option of the layer (%s)", fn, name,
                     "set by the layer" if name in _MOE_FIXED[:4] else
                     "memory: pass it to forward()" if name != "stream" else
                     "the current torch stream is used")
    if route_config is not None and not isinstance(route_config, _epx.RouteConfig):
        raise TypeError("%s: route_config is a %s; pass an epx.RouteConfig"
                        % (fn, type(route_config).__name__))
    config = route_config.copy() if route_config is not None else _epx.RouteConfig()
    if route_config is None and "nonfinite" not in options:
        # refusing NaN logits costs a host wait per route on CUDA
        options = dict(options, nonfinite=_epx.Nonfinite.DROP if on_gpu else _epx.Nonfinite.ERROR)
    options = {k: int(v) if isinstance(v, bool) else v for k, v in options.items()}
    config = config.copy(num_experts=num_experts, top_k=top_k, device=Device.CPU, stream=None,
                         token_mask=None, aux_loss_expert_counts=None, **options)
    if capacity_factor is not None:
        field = ("capacity_factor_f64"
                 if config.capacity_arithmetic == _epx.CapacityArithmetic.FLOAT64
                 else "capacity_factor")
        config = config.copy(capacity_mode=1, **{field: capacity_factor})
    _route_capacity(config, 0)  # a bad config is refused here, not at the first forward
    return config


class MoE(_torch.nn.Module):
    """A Mixture-of-Experts layer over an epx comm: a float32 router (epx_route
    with the library's routing options), this rank's E/W SwiGLU experts
    through grouped matmuls, dispatch and combine. forward(x [..., H],
    token_mask=None, aux_loss_expert_counts=None) -> [..., H];
    ``self.aux_loss`` is the step's aux + z loss (add it to the loss so the
    router learns balance).

    Parameters: router.weight [E, H] float32 (replicated: all-reduce its
    gradient over data parallel ranks as usual), w_gate_up [E_local, 2F, H]
    (gate rows first, then up) and w_down [E_local, H, F] in `dtype`, laid
    out [out, in] like nn.Linear (this rank's experts, global ids
    rank*E_local ...), and expert_bias [E] (selection only, no gradient) when
    expert_bias=True. expert_alignment pads each expert's group of rows
    (default 8 on CUDA, as grouped GEMM kernels like, 1 on CPU).

    weighting: where the routing weights are applied (IN_COMBINE default;
    IN_DISPATCH; NONE: the experts scale their activations by recv_w) — the
    router gets its gradient in every one. layout EXPERT_MAJOR (dropless,
    or capacity routing with drops) or CAPACITY ([E_local, W*C, H], needs
    capacity_factor). max_tokens_per_rank: the most tokens a forward gets
    (needed: it sizes every receive tensor). exact_size: the experts get
    exactly the N received rows instead of the worst case (one host sync per
    forward; see :func:`dispatch` for the memory of each mode). generator: a
    CPU torch.Generator for the initial weights (each rank keeps its own
    experts' draws, so global expert e starts the same whatever the rank
    count).

    The router: every field of epx.RouteConfig is a keyword argument
    (score_fn, num_groups, topk_groups, group_score_experts, renormalize,
    renormalize_after_drop, scaling_factor, min_capacity, queue_order,
    drop_policy, random_seed, capacity_arithmetic, aux_counts,
    aux_loss_coeff, z_loss_coeff, aux_loss_sequences, aux_loss_tokens,
    nonfinite), or pass a whole ``route_config`` (the keywords override
    it). capacity_factor turns capacity mode on (a double under
    CapacityArithmetic.FLOAT64). nonfinite defaults to DROP on CUDA (ERROR
    costs a host wait per step and cannot be captured in a CUDA graph); a
    route_config keeps its own nonfinite (epx.RouteConfig() has ERROR: on
    CUDA set nonfinite=DROP there or as a keyword). The two memory fields are forward's
    arguments: token_mask [...] (bool, True = a real token; padding routes
    nowhere and counts in no loss) and aux_loss_expert_counts [E] (the
    global aux loss's counts, e.g. summed over ranks).

    ``self.aux_loss`` keeps the last forward's autograd graph alive until
    the next forward; with it, the parameters' gradient accumulators, whose
    CUDA stream is the one they were made on. Before a CUDA-graph warm-up
    on a side stream, after eager steps, set ``layer.aux_loss = None`` (or
    the capture fails: the accumulators would sync with the default
    stream).

    fp8=True (DeepEP's e4m3 with float32 scales per 128) or an
    epx.FP8Format: the tokens are quantized on the way (epx_dispatch_quantize,
    half the bytes of a bf16 dispatch) and the experts run on the
    dequantized rows (:func:`dequantize`; PyTorch's scaled grouped GEMM
    takes per-row scales on sm_90, none per block of 128 or 32, so the
    GEMMs are in the layer's dtype: ``self.fp8_gemm`` says which ran,
    "dequantized"); the backward is a dispatch's of those rows (straight
    through the quantizer) and combine stays in the layer's dtype.

    placement: an epx.Placement (round-robin rule) for elastic expert
    parallelism: the rank's local experts are its physical experts
    (num_local_experts = P / W, w_gate_up and w_down hold them in slot
    order, a replica starting with its logical expert's weights), and
    ``self.placement`` is it (None: the contiguous map). In training, call
    epx.torch.replica_grad_sum(layer) after backward; epx.torch.move_experts
    moves the layer to a new placement (epx.torch.elastic; CPU layers)."""

    def __init__(self, comm, hidden_size, ffn_hidden_size, num_experts, top_k, *,
                 max_tokens_per_rank, dtype=_F32, device="cpu", weighting=Weighting.IN_COMBINE,
                 exchange=Exchange.DEDUP, layout=Layout.EXPERT_MAJOR, expert_alignment=None,
                 combine_precision=0, capacity_factor=None, expert_bias=False, generator=None,
                 exact_size=False, route_config=None, fp8=None, placement=None,
                 **route_options):
        super().__init__()
        self.exact_size = bool(exact_size)
        self.fp8 = _epx.FP8Format(_epx.FP8Format.E4M3_F32_128 if fp8 is True else int(fp8 or 0))
        if self.fp8 and (self.exact_size or Weighting(weighting) == Weighting.IN_DISPATCH):
            _invalid("epx.torch.MoE: fp8 dispatch with %s is not offered; use exact_size=False "
                     "and weights in combine or NONE", "exact_size" if self.exact_size
                     else "Weighting.IN_DISPATCH (fp8 rows are not scaled on the way)")
        W = comm.size
        self.placement = layer_placement(placement, num_experts, W)
        if Layout(layout) == Layout.RANK_MAJOR:
            _refuse(Status.ERROR_UNSUPPORTED, "epx.torch.MoE: the rank-major layout has no "
                    "expert groups for a grouped matmul; use EXPERT_MAJOR or CAPACITY (or "
                    "epx.torch.dispatch with your own experts)")
        on_gpu = _torch.device(device).type == "cuda"
        self.route_config = _moe_route_config(num_experts, top_k, capacity_factor, on_gpu,
                                              route_config, route_options)
        if Layout(layout) == Layout.CAPACITY and not self.route_config.capacity_mode:
            _invalid("epx.torch.MoE: layout CAPACITY needs capacity_factor")
        if expert_alignment is None:
            expert_alignment = 8 if on_gpu else 1
        self.comm, self.hidden_size, self.ffn_hidden_size = comm, hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = (self.placement.num_physical if self.placement is not None
                                  else num_experts) // W
        self.weighting, self.layout = Weighting(weighting), Layout(layout)
        capacity = (_epx.route_capacity(max_tokens_per_rank, self.route_config)
                    if self.layout == Layout.CAPACITY else 0)
        self.buffer = make_buffer(comm, hidden=hidden_size, num_experts=num_experts,
                                  max_top_k=top_k, max_tokens_per_rank=max_tokens_per_rank,
                                  dtype=dtype, device=device, exchange=exchange, layout=layout,
                                  expert_alignment=expert_alignment, capacity=capacity,
                                  combine_precision=combine_precision, fp8_format=self.fp8,
                                  placement=self.placement)
        self._buffer_id = self.buffer.id
        self._config_id = _config_id(self.route_config)
        # the GEMMs the experts run on fp8 rows (the class docstring says why)
        self.fp8_gemm = "dequantized" if self.fp8 else None
        self._init_parameters(device, dtype, generator, expert_bias)
        self.aux_loss = None

    def _init_parameters(self, device, dtype, g, expert_bias):
        """Random weights scaled by 1/sqrt(fan-in). From `g` (a CPU
        generator) when given: the router, then every global expert's
        gate/up, then every expert's down weights, in expert order, each rank
        keeping its own experts', so global expert e has the same weights
        whatever the rank count (every rank draws all E, one expert at a
        time). Ranks that are threads of one process (epx.run_local) would
        share torch's global generator, in a racy order: without `g` they
        draw as from a generator seeded with torch.initial_seed(). Else from
        the device's default generator directly in `dtype` (no float32 copy
        on the host: a DeepSeek-sized layer's experts are tens of GB)."""
        dtype = torch_dtype(dtype)
        El, H, F, E = self.num_local_experts, self.hidden_size, self.ffn_hidden_size, \
            self.num_experts
        if g is None and (getattr(self.comm, "_world", None) is not None
                          or self.placement is not None):  # replicas start equal
            g = _torch.Generator().manual_seed(_torch.initial_seed())
        mine = local_logical(self.placement, E, self.comm.rank, self.comm.size)

        def draw(*shape, fan_in, dt):
            if g is None:
                return _torch.randn(*shape, device=device, dtype=dt).mul_(1.0 / math.sqrt(fan_in))
            return (_torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(device=device,
                                                                           dtype=dt)

        def draw_experts(*shape, fan_in):
            if g is None:
                return draw(El, *shape, fan_in=fan_in, dt=dtype)
            drawn = {e: w for e, w in ((e, draw(*shape, fan_in=fan_in, dt=dtype))
                                       for e in range(E)) if e in mine}
            return _torch.stack([drawn[e] for e in mine])
        self.router = _torch.nn.Linear(H, E, bias=False, device=device)
        with _torch.no_grad():
            self.router.weight.copy_(draw(E, H, fan_in=H, dt=_F32))
        self.w_gate_up = _torch.nn.Parameter(draw_experts(2 * F, H, fan_in=H))
        self.w_down = _torch.nn.Parameter(draw_experts(H, F, fan_in=F))
        self.register_buffer("expert_bias", _torch.zeros(E, device=device)
                             if expert_bias else None)

    def experts(self, d):
        """SwiGLU over the expert-major groups of a :class:`Dispatched`:
        [N_max, H] -> [N_max, H]."""
        ends = d.offsets[1:].to(_I32)
        h = grouped_mm(d.recv_x, self.w_gate_up.transpose(-2, -1), ends)
        gate, up = h.chunk(2, dim=-1)
        act = _F.silu(gate) * up
        if self.weighting == Weighting.NONE:
            act = act * d.recv_w.unsqueeze(-1).to(act.dtype)
        return grouped_mm(act, self.w_down.transpose(-2, -1), ends)

    def _check_input(self, x):
        fn = "epx.torch.MoE.forward"
        if not isinstance(x, Tensor):
            raise TypeError("%s: x is a %s; pass a tensor [..., %d]"
                            % (fn, type(x).__name__, self.hidden_size))
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            _invalid("%s: x has shape %s but the layer's hidden size is %d; pass x "
                     "[..., %d]", fn, tuple(x.shape), self.hidden_size, self.hidden_size)
        want = self.w_gate_up.dtype
        if x.dtype != want:
            _invalid("%s: x is %s but the layer's experts are %s; pass x.to(%s)", fn,
                     x.dtype, want, want)
        if x.device != self.w_gate_up.device:
            _invalid("%s: x is on %s but the layer is on %s; move one of them", fn,
                     x.device, self.w_gate_up.device)

    def forward(self, x, token_mask=None, aux_loss_expert_counts=None, return_counts=False):
        """x [..., H] -> out [..., H]; with return_counts, (out, expert_counts)
        where expert_counts [E] int32 are the tokens this rank routed to each
        expert (DeepSpeed's exp_counts; on the device, no host wait). Also
        kept: ``self.expert_counts`` and ``self.tokens_per_expert`` ([E_local]
        int64 rows this rank's experts received)."""
        self._check_input(x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        logits = _F.linear(x2.float(), self.router.weight.float())
        dev = Device.CUDA if x.is_cuda else Device.CPU
        if token_mask is not None:
            token_mask = token_mask.reshape(-1)
        mask, counts = _route_tensors("epx.torch.MoE.forward", x2.shape[0], self.num_experts, dev,
                                      token_mask, aux_loss_expert_counts)
        outs = _torch.ops.epx.route(logits, self.expert_bias, mask, counts, self._config_id)
        idx, w, loc, expert_counts, aux, z, _ = outs
        self.aux_loss = aux + z
        self.expert_counts = expert_counts
        locations = loc if self.layout == Layout.CAPACITY else None
        if self.fp8:
            outs = _Fp8StraightThrough.apply(x2, idx, w, locations, self._buffer_id,
                                             int(self.weighting), RECORDER_AMBIENT)
        else:
            op = _torch.ops.epx.dispatch_exact if self.exact_size else _torch.ops.epx.dispatch
            outs = op(x2, idx, w, locations, self._buffer_id, int(self.weighting), RECORDER_AMBIENT)
        d = Dispatched(*outs, w, x2.shape[0], self.top_k, int(self.weighting), self._buffer_id)
        self.tokens_per_expert = d.counts
        out = combine(d, self.experts(d)).reshape(shape)
        return (out, expert_counts) if return_counts else out
