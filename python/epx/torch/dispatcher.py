"""TokenDispatcher: Megatron-core's token-dispatcher interface over epx, for
porting a Megatron MoE layer by hand."""
import torch as _torch
from torch import Tensor

from epx import Device, Status, Weighting
from epx.errors import _invalid, _refuse
from .functional import combine, dispatch, make_buffer
from .tensors import _F32, _I32, torch_dtype


def routing_map_topk(routing_map, probs, top_k):
    """Megatron's routing_map [T, E] (bool, or nonzero = selected) and probs
    [T, E] -> (topk_idx [T, top_k] int32, topk_w [T, top_k] float32): each
    token's selected experts in ascending id order (the order Megatron
    permutes in), -1 and weight 0 past its last."""
    E = routing_map.shape[1]
    rank_of = (E - _torch.arange(E, device=routing_map.device)).to(_I32)
    top, idx = _torch.topk(routing_map.to(_I32) * rank_of, top_k, dim=1)
    chosen = top > 0
    idx = _torch.where(chosen, idx, -1).to(_I32)
    w = _torch.where(chosen, probs.gather(1, idx.clamp(min=0).long()).float(),
                     _torch.zeros((), device=probs.device))
    return idx, w


def check_routing_map_rows(fn, chosen, top_k, limit):
    """Refuses a routing map (bool [T, E]) whose row selects more than top_k
    experts (the topk would drop the extra ones silently); limit says why,
    formatted with (top_k, the most a row selects). Reads the map on the
    host (a device wait on CUDA)."""
    per_row = chosen.sum(dim=1)
    worst = int(per_row.max()) if per_row.numel() else 0
    if worst > top_k:
        row = int(_torch.argmax((per_row > top_k).to(_I32)))
        _invalid("%s: routing_map row %d selects %d experts" + limit, fn, row,
                 int(per_row[row]), top_k, worst)


class TokenDispatcher:
    """Megatron-core's token-dispatcher interface over epx, for porting a
    Megatron MoE layer: ``token_permutation(hidden_states, probs,
    routing_map)`` -> (global_input_tokens, tokens_per_expert) and
    ``token_unpermutation(expert_output)`` -> (output, None), also named
    dispatch / combine. probs [T, E] (dense router probabilities) and
    routing_map [T, E] bool (the selected experts) are Megatron's; the
    weights are applied in combine (Megatron's unpermute), and their
    gradient flows back into probs.

    global_input_tokens [N_max, H] are grouped by local expert
    (``self.tokens_per_expert`` rows each, a device tensor: no host wait;
    :meth:`tokens_per_expert_host` gives a list); rows past the valid count
    are zeros. exact_size=True: [N, H], the received rows only, as Megatron
    returns (one host sync per dispatch; see :func:`dispatch` for each mode's
    memory). validate (default True): routing_map rows with more than top_k
    experts, and selected experts whose probability is not positive and
    finite, are refused (a host read of the map per call; False skips it,
    e.g. inside a CUDA graph)."""

    def __init__(self, comm, num_experts, hidden_size, top_k, *, max_tokens_per_rank,
                 dtype=_F32, device="cpu", weighting=Weighting.IN_COMBINE, validate=True,
                 exact_size=False, **buffer_fields):
        self.num_experts, self.top_k = num_experts, top_k
        self.validate, self.exact_size = bool(validate), bool(exact_size)
        self.num_local_experts = num_experts // comm.size
        self.local_expert_indices = list(range(comm.rank * self.num_local_experts,
                                               (comm.rank + 1) * self.num_local_experts))
        self.weighting = Weighting(weighting)
        self.buffer = make_buffer(comm, hidden=hidden_size, num_experts=num_experts,
                                  max_top_k=top_k, max_tokens_per_rank=max_tokens_per_rank,
                                  dtype=dtype, device=device, **buffer_fields)
        self._d = None
        self._shape = None
        self.tokens_per_expert = None

    def token_permutation(self, hidden_states, probs, routing_map):
        """hidden_states [..., H], probs [T, E], routing_map [T, E] bool ->
        (global_input_tokens [N_max, H], tokens_per_expert [E_local])."""
        self._check_permutation_inputs(hidden_states, probs, routing_map)
        if self.validate:
            self._check_routing(hidden_states, probs, routing_map)
        self._shape = hidden_states.shape
        x = hidden_states.reshape(-1, self._shape[-1])
        idx, w = routing_map_topk(routing_map, probs, self.top_k)
        self._d = dispatch(self.buffer, x, idx, w, weighting=self.weighting,
                           exact_size=self.exact_size)
        self.tokens_per_expert = self._d.counts
        return self._d.recv_x, self._d.counts

    dispatch = token_permutation

    def _check_permutation_inputs(self, hidden_states, probs, routing_map):
        fn = "TokenDispatcher.token_permutation"
        H, E = self.buffer.hidden, self.num_experts
        if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 1 or \
                hidden_states.shape[-1] != H:
            _invalid("%s: hidden_states has shape %s; expected [..., %d] (a torch.Tensor)",
                     fn, list(getattr(hidden_states, "shape", [])), H)
        T = hidden_states.numel() // H
        for name, t in (("probs", probs), ("routing_map", routing_map)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (T, E):
                _invalid("%s: %s has shape %s; expected [%d, %d] (tokens, experts)", fn,
                         name, list(getattr(t, "shape", [])), T, E)
        if not probs.dtype.is_floating_point:
            _invalid("%s: probs has dtype %s; pass the router's float probabilities", fn,
                     probs.dtype)
        if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
            _invalid("%s: routing_map has dtype %s; pass Megatron's bool map", fn,
                     routing_map.dtype)

    def _check_routing(self, hidden_states, probs, routing_map):
        """What the dispatch would otherwise get wrong silently: rows of
        routing_map with more than top_k experts (the extra ones would be
        dropped), selected experts without a positive finite probability
        (probs and map that disagree: Megatron's sparse probs from another
        routing, or another token order), tokens of another dtype or device
        than the buffer's. probs may be dense (only the selected entries are
        read) or Megatron's sparse ones. Reads the map on the host (a device
        wait on CUDA; validate=False skips)."""
        fn = "TokenDispatcher.token_permutation"
        want = torch_dtype(self.buffer.dtype)
        if hidden_states.dtype != want:
            _invalid("%s: hidden_states is %s but the dispatcher's buffer is %s; pass "
                     "hidden_states.to(%s) (or make the dispatcher with dtype=%s)", fn,
                     hidden_states.dtype, want, want, hidden_states.dtype)
        dev_kind = "cuda" if self.buffer.device == Device.CUDA else "cpu"
        for name, t in (("hidden_states", hidden_states), ("probs", probs),
                        ("routing_map", routing_map)):
            if t.device.type != dev_kind:
                _invalid("%s: %s is on %s but the dispatcher's buffer is on %s; move it",
                         fn, name, t.device, dev_kind)
        chosen = routing_map != 0
        check_routing_map_rows(fn, chosen, self.top_k, " but top_k is %d; every token may go to "
                               "at most top_k experts (make the dispatcher with top_k=%d, or "
                               "fix the router)")
        weightless = chosen & ~(probs > 0) & ~_torch.isinf(probs)
        weightless |= chosen & ~_torch.isfinite(probs)
        if bool(weightless.any()):
            t, e = (int(v) for v in weightless.nonzero()[0])
            _invalid("%s: routing_map[%d, %d] selects expert %d but probs[%d, %d] is %g; "
                     "every selected expert needs a positive, finite probability (are probs "
                     "and routing_map from the same router call, in the same token "
                     "order?)", fn, t, e, e, t, e, float(probs[t, e]))

    def token_unpermutation(self, hidden_states, bias=None):
        """expert output [N_max, H] -> (output in the shape of the
        dispatched hidden_states, None). bias is refused (Megatron's
        mlp_bias path has no epx equivalent yet)."""
        if bias is not None:
            _refuse(Status.ERROR_UNSUPPORTED, "TokenDispatcher.token_unpermutation: bias is "
                    "not supported; add it to the expert output before combine")
        if self._d is None:
            _invalid("TokenDispatcher.token_unpermutation: call token_permutation first")
        out = combine(self._d, hidden_states)
        self._d = None
        return out.reshape(self._shape), None

    def combine(self, hidden_states):
        return self.token_unpermutation(hidden_states)[0]

    def tokens_per_expert_host(self):
        """tokens_per_expert as a list of ints (waits for the device on CUDA)."""
        return [int(c) for c in self.tokens_per_expert.tolist()]

    def close(self):
        """Closes the dispatcher's buffer (not collective). A dispatch whose
        combine or backward has not run still holds it: epx.BusyError, as
        Buffer.close. Closing twice does nothing."""
        self._d = None
        self.tokens_per_expert = None
        self.buffer.close()

    @property
    def closed(self):
        return self.buffer.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
