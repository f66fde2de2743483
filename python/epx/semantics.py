"""What each op of the exchange produces and what its backward needs, for
every binding: output shapes and dtypes, which backward pairs with which
forward, what each op saves for it, what a handle carries, and the fp8
formats (block, scale dtype, how a scale decodes). Framework-neutral: shapes
are tuples of ints, dtypes are names, and `where` says whether an output
lives with the inputs ("device") or on the host ("host"). epx.torch's fake
functions, ops and autograd read these; a later binding (a DeepEP-shaped
API, JAX) reads them instead of copying them. include/epx.h is the contract
these restate."""
from typing import NamedTuple, Optional, Tuple

from ._lib import FP8Format, Layout, Weighting

# Dtype names: "payload" is the dtype of the op's payload input (x,
# expert_out, a gradient); "fp8" is e4m3fn bytes; the others are numpy's.
PAYLOAD = "payload"
FP8 = "fp8"


class Out(NamedTuple):
    """One output of an op: its name, shape, dtype name and where it lives."""
    name: str
    shape: Tuple[int, ...]
    dtype: str
    where: str = "device"


# ---------------------------------------------------------------------------
# The fp8 formats (src/core/fp8.h)
# ---------------------------------------------------------------------------


class Fp8Layout(NamedTuple):
    """An fp8 format's scales: one scale per `block` columns of a row, stored
    as `scale_dtype` (`per_word` scales packed in one element)."""
    block: int
    scale_dtype: str
    per_word: int


FP8_FORMATS = {
    FP8Format.E4M3_F32_128: Fp8Layout(128, "float32", 1),   # a float32 per 128 columns
    FP8Format.E4M3_UE8M0_128: Fp8Layout(128, "int32", 4),   # 4 UE8M0 bytes per int32 (512 cols)
    FP8Format.MXFP8: Fp8Layout(32, "uint8", 1),             # an E8M0 byte per 32 columns
}


def fp8_scale_dtype(fmt):
    """The dtype name of an fp8 format's scales."""
    return FP8_FORMATS[FP8Format(fmt)].scale_dtype


def fp8_scale_bits(fmt, exponent, where):
    """The float32 bits (as int32) of power-of-two scales from their exponent
    bytes (int32 values 0..255) of a UE8M0 or MXFP8 format: the byte is the
    float's exponent field. A UE8M0 byte of 255 is infinite (its bits as
    they are); an MXFP8 E8M0 byte of 255 is NaN and 0 is 2^-127 (a
    subnormal). `where` is the array library's where (numpy.where,
    torch.where), so the one rule serves every binding."""
    bits = exponent << 23
    if FP8Format(fmt) == FP8Format.MXFP8:
        bits = where(exponent == 255, 0x7FFFFFFF, where(exponent == 0, 0x00400000, bits))
    return bits


# ---------------------------------------------------------------------------
# Output shapes of each op
# ---------------------------------------------------------------------------


def recv_w_shape(layout, rows, top_k):
    """recv_w and recv_expert: a row's K slots in the rank-major layout (a
    token sent once per rank), one per row in the expert-major one."""
    return (rows, top_k) if Layout(layout) == Layout.RANK_MAJOR else (rows,)


def route_outputs(num_tokens, top_k, num_experts):
    """epx_route: (topk_idx, topk_w, locations, expert_counts, aux_loss,
    z_loss, info); info is (capacity, dropped) on the host."""
    T, K, E = num_tokens, top_k, num_experts
    return (Out("topk_idx", (T, K), "int32"), Out("topk_w", (T, K), "float32"),
            Out("locations", (T, K), "int32"), Out("expert_counts", (E,), "int32"),
            Out("aux_loss", (), "float32"), Out("z_loss", (), "float32"),
            Out("info", (2,), "int64", "host"))


def route_backward_outputs(num_tokens, num_experts):
    """epx_route_backward: the logits' gradient."""
    return (Out("grad_logits", (num_tokens, num_experts), "float32"),)


def _recv_metadata(rows, top_k, experts_per_rank, layout):
    shape = recv_w_shape(layout, rows, top_k)
    n = experts_per_rank
    return (Out("recv_w", shape, "float32"), Out("recv_expert", shape, "int32"),
            Out("counts", (n,), "int64"), Out("offsets", (n + 1,), "int64"),
            Out("rows", (1,), "int64"), Out("handle", (1,), "int64", "host"))


def dispatch_outputs(rows, hidden, top_k, experts_per_rank, layout):
    """epx_dispatch: recv_x [rows, H] (rows: the buffer's worst case, or the
    exact count), its weights and experts, the per-expert counts and
    offsets, the valid row count, and the handle (a host token)."""
    return ((Out("recv_x", (rows, hidden), PAYLOAD),)
            + _recv_metadata(rows, top_k, experts_per_rank, layout))


def dispatch_fp8_outputs(rows, hidden, top_k, experts_per_rank, layout, fmt, scale_cols):
    """epx_dispatch_fp8: dispatch's outputs with recv_x as e4m3 rows and
    their scales."""
    return (dispatch_fp8_payload(rows, hidden, fmt, scale_cols)
            + _recv_metadata(rows, top_k, experts_per_rank, layout))


def dispatch_fp8_payload(rows, hidden, fmt, scale_cols):
    """The fp8 rows and their scales (a cached fp8 dispatch returns only these)."""
    return (Out("recv_x_q", (rows, hidden), FP8),
            Out("recv_scales", (rows, scale_cols), fp8_scale_dtype(fmt)))


def dispatch_backward_outputs(num_tokens, hidden, top_k):
    """epx_dispatch_backward: grad_x [T, H] and grad_w [T, K] (zeros unless
    the weights were applied in dispatch)."""
    return (Out("grad_x", (num_tokens, hidden), PAYLOAD),
            Out("grad_w", (num_tokens, top_k), "float32"))


def weights_backward_outputs(num_tokens, top_k):
    """epx_weights_backward: recv_w's gradient back to topk_w."""
    return (Out("grad_w", (num_tokens, top_k), "float32"),)


def combine_outputs(num_tokens, hidden):
    """epx_combine: out [T, H], each token's rows summed."""
    return (Out("out", (num_tokens, hidden), PAYLOAD),)


def combine_backward_outputs(rows, hidden, num_tokens, top_k):
    """epx_combine_backward: the expert output's gradient [rows, H] and
    grad_w [T, K] (zeros unless the weights were applied in combine)."""
    return (Out("grad_expert_out", (rows, hidden), PAYLOAD),
            Out("grad_w", (num_tokens, top_k), "float32"))


# ---------------------------------------------------------------------------
# Forward and backward: which backward each forward's gradients go through,
# and what the forward keeps for it
# ---------------------------------------------------------------------------

BACKWARD = {
    "route": ("route_backward",),                     # topk_w, aux and z losses -> logits
    "dispatch": ("dispatch_backward", "weights_backward"),  # recv_x -> x; recv_w -> topk_w
    "dispatch_exact": ("dispatch_backward", "weights_backward"),
    "dispatch_fp8": ("weights_backward",),            # fp8 rows carry no gradient
    "dispatch_cached": ("dispatch_backward",),
    "dispatch_fp8_cached": (),
    "combine": ("combine_backward",),                 # out -> expert_out (and topk_w)
    "grouped_mm_loop": ("grouped_mm_loop", "grouped_mm_weight_grad"),  # x, then w
}

# Quantize-on-dispatch whose experts see the dequantized rows: it runs the fp8
# op and keeps what that op keeps (SAVES), and its gradients are those of the
# op it stands for, straight through the quantizer (that op's BACKWARD).
STRAIGHT_THROUGH = {"dispatch_fp8": "dispatch"}

# When a conditional item is kept: a condition's name and the weighting it
# needs (None: any). Each holds only where topk_w is given and needs a
# gradient.
W_GRAD = "w_grad"
W_IN_DISPATCH = "w_in_dispatch"
W_IN_COMBINE = "w_in_combine"
CONDITIONS = {W_GRAD: None, W_IN_DISPATCH: Weighting.IN_DISPATCH,
              W_IN_COMBINE: Weighting.IN_COMBINE}


class Saved(NamedTuple):
    """A tensor an op keeps for its backward: an input (by the op's argument
    name) or an output (by its name in OUTPUT_NAMES), kept only when the
    condition `when` holds (None: always; else nothing is kept in its place)."""
    name: str
    when: Optional[str] = None


class Attr(NamedTuple):
    """A value (not a tensor) an op keeps for its backward: the input `of`,
    or its size along `dim`; `default` where that input is absent."""
    name: str
    of: str
    dim: Optional[int] = None
    default: Optional[int] = None


class Saves(NamedTuple):
    """What an op keeps for its backward: tensors, values, and the conditions
    (CONDITIONS) the backward asks again."""
    tensors: Tuple[Saved, ...] = ()
    attrs: Tuple[Attr, ...] = ()
    flags: Tuple[str, ...] = ()


_ROUTING_SIZES = (Attr("num_tokens", "topk_idx", 0), Attr("top_k", "topk_idx", 1))

SAVES = {
    "route": Saves((Saved("logits"), Saved("bias"), Saved("token_mask"), Saved("aux_counts"),
                    Saved("topk_idx")), (Attr("config_id", "config_id"),)),
    "dispatch": Saves((Saved("handle"), Saved("x", W_IN_DISPATCH)), _ROUTING_SIZES,
                      (W_GRAD, W_IN_DISPATCH)),
    "dispatch_exact": Saves((Saved("handle"), Saved("x", W_IN_DISPATCH)), _ROUTING_SIZES,
                            (W_GRAD, W_IN_DISPATCH)),
    "dispatch_fp8": Saves((Saved("handle"),), _ROUTING_SIZES, (W_GRAD,)),
    "dispatch_cached": Saves((Saved("token"),), (Attr("num_tokens", "x", 0),
                                                 Attr("top_k", "top_k"))),
    "dispatch_fp8_cached": Saves(),
    "combine": Saves((Saved("token"), Saved("expert_out", W_IN_COMBINE)),
                     (Attr("rows", "expert_out", 0), Attr("top_k", "topk_w", 1, default=1)),
                     (W_IN_COMBINE,)),
    "grouped_mm_loop": Saves((Saved("x"), Saved("w"), Saved("ends"))),
}

# The names of each op's outputs, in order (the shape functions above give
# the same names); a saved output is found by its name here.
_RECV = ("recv_w", "recv_expert", "counts", "offsets", "rows", "handle")
OUTPUT_NAMES = {
    "route": ("topk_idx", "topk_w", "locations", "expert_counts", "aux_loss", "z_loss", "info"),
    "dispatch": ("recv_x",) + _RECV,
    "dispatch_exact": ("recv_x",) + _RECV,
    "dispatch_fp8": ("recv_x_q", "recv_scales") + _RECV,
    "dispatch_cached": ("recv_x",),
    "dispatch_fp8_cached": ("recv_x_q", "recv_scales"),
    "combine": ("out",),
    "grouped_mm_loop": ("out",),
}

# What a handle carries from its dispatch to every later call on it (combine,
# the backward passes, a cached dispatch): the layout of each (token, k) slot
# (its receive row on its rank), the row and per-expert counts, the
# weighting, and the routing (topk_idx, topk_w) that a replay validates.
HANDLE_CARRIES = ("layout", "rows", "counts", "weighting", "routing")
