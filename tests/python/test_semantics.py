"""epx.semantics, the layer every binding reads: the real ops' outputs have
the shapes and dtypes it states (so the fake functions built from it agree
with the ops), its fp8 scale dtypes are the C library's scale sizes, and
its scale decoding gives numpy's and torch's dequantize the C library's
bits."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from epx import semantics  # noqa: E402

F = epx.FP8Format
TORCH_OF = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}


def check_outputs(tensors, outs, payload):
    assert len(tensors) == len(outs)
    for t, o in zip(tensors, outs):
        assert tuple(t.shape) == o.shape, o.name
        assert t.dtype == (payload if o.dtype == semantics.PAYLOAD else TORCH_OF[o.dtype]), o.name
        assert t.device.type == "cpu", o.name


@pytest.mark.parametrize("layout", [epx.Layout.EXPERT_MAJOR, epx.Layout.RANK_MAJOR])
def test_dispatch_and_combine_outputs_are_the_semantics(layout):
    T, H, E, K = 6, 32, 4, 2
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g)
    x = torch.randn(T, H, generator=g)
    r = et.route(logits, top_k=K)
    with epx.Comm.create_self() as comm:
        b = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T,
                           layout=layout)
        w = int(epx.Weighting.NONE)  # every layout's (rank-major's only one)
        outs = torch.ops.epx.dispatch(x, r.topk_idx, r.topk_w, None, b.id, w, et.RECORDER_NONE)
        rows = outs[0].shape[0]
        check_outputs(outs, semantics.dispatch_outputs(rows, H, K, b.experts_per_rank, layout),
                      x.dtype)
        out = torch.ops.epx.combine(outs[0], None, outs[-1], T, w)
        check_outputs((out,), semantics.combine_outputs(T, H), x.dtype)
        del outs  # the handle's token: the buffer closes once it is gone
        b.close()


def test_route_outputs_are_the_semantics():
    logits = torch.randn(5, 8)
    config = epx.RouteConfig(num_experts=8, top_k=3)
    from epx.torch.routing import _config_id
    outs = torch.ops.epx.route(logits, None, None, None, _config_id(config))
    for t, o in zip(outs, semantics.route_outputs(5, 3, 8)):
        assert tuple(t.shape) == o.shape and t.dtype == TORCH_OF[o.dtype], o.name
        assert t.device.type == "cpu"


@pytest.mark.parametrize("fmt", [F.E4M3_F32_128, F.E4M3_UE8M0_128, F.MXFP8])
def test_fp8_scales_decode_as_the_library(fmt):
    H = 512
    x = np.random.default_rng(3).standard_normal((4, H)).astype(np.float32) * 100
    x[0, :32] = 0  # a zero block: the smallest scale
    q, s = epx.quantize(x, fmt)
    cols, dtype = epx.fp8_scale_shape(fmt, H)
    assert s.shape == (4, cols) and dtype == np.dtype(semantics.fp8_scale_dtype(fmt))
    want = epx.dequantize(q, s, fmt)
    got = et.dequantize(torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(s), fmt,
                        torch.float32)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    if fmt != F.E4M3_F32_128:  # the same rule over numpy arrays
        exponent = s.view(np.uint8).reshape(4, -1).astype(np.int32)
        scale = semantics.fp8_scale_bits(fmt, exponent, np.where).astype(np.int32).view(np.float32)
        e4m3 = torch.from_numpy(q).view(torch.float8_e4m3fn).float().numpy()
        block = semantics.FP8_FORMATS[fmt].block
        mine = (e4m3.reshape(4, -1, block) * scale[:, :, None]).reshape(4, H)
        np.testing.assert_array_equal(mine.view(np.uint32), want.view(np.uint32))


def test_autograd_tables_name_the_ops():
    """Every op with an autograd has its pairing, its saves and its output
    names; each saved or sized input is an argument of the op, each saved
    output one of its outputs, and every paired backward is an epx op."""
    assert set(semantics.BACKWARD) == set(semantics.SAVES) == set(semantics.OUTPUT_NAMES)
    for op, saves in semantics.SAVES.items():
        args = {a.name for a in getattr(torch.ops.epx, op).default._schema.arguments}
        known = args | set(semantics.OUTPUT_NAMES[op])
        for t in saves.tensors:
            assert t.name in known and t.when in (None,) + tuple(semantics.CONDITIONS), (op, t)
        assert all(a.of in args for a in saves.attrs), op
        assert set(saves.flags) <= set(semantics.CONDITIONS), op
        for backward in semantics.BACKWARD[op]:
            assert hasattr(torch.ops.epx, backward), (op, backward)


def test_output_names_are_the_shape_functions():
    L = epx.Layout.EXPERT_MAJOR
    names = {"route": semantics.route_outputs(4, 2, 8),
             "dispatch": semantics.dispatch_outputs(8, 32, 2, 4, L),
             "dispatch_fp8": semantics.dispatch_fp8_outputs(8, 512, 2, 4, L, F.MXFP8, 16),
             "dispatch_fp8_cached": semantics.dispatch_fp8_payload(8, 512, F.MXFP8, 16),
             "combine": semantics.combine_outputs(4, 32)}
    for op, outs in names.items():
        assert tuple(o.name for o in outs) == semantics.OUTPUT_NAMES[op], op
    assert semantics.OUTPUT_NAMES["dispatch_exact"] == semantics.OUTPUT_NAMES["dispatch"]
