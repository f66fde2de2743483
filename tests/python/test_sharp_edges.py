"""Issue 38's sharp edges in the Python layer, each a case that used to
surprise a user: a keyword that did nothing (route's capacity_factor), a
result that silently had no gradient (ll_dispatch), inputs accepted that
mean nothing (meta tensors), errors that named no argument, the drop-ins'
buffer sizing, and calls that could hang or lose state.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_sharp_edges.py
"""
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from test_epx import SEED  # noqa: E402

torch.set_num_threads(1)


def test_route_capacity_factor_turns_capacity_on():
    """capacity_factor as a keyword of route / route_capacity does what
    MoE(capacity_factor=) does: capacity mode, drops past C."""
    assert epx.route_capacity(40, num_experts=4, top_k=1, capacity_factor=0.5) == 5
    assert epx.route_capacity(40, num_experts=4, top_k=1, capacity_factor_f64=0.5,
                              capacity_arithmetic=epx.CapacityArithmetic.FLOAT64) == 5
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(40, 4, generator=g)
    r = et.route(logits, top_k=1, capacity_factor=0.5)
    assert r.capacity == 5 and int((r.topk_idx >= 0).sum()) <= 4 * 5
    n = epx.route(logits.numpy(), top_k=1, capacity_factor=0.5)
    assert n.capacity == 5 and np.array_equal(n.topk_idx, r.topk_idx.numpy())
    with pytest.raises(epx.InvalidArgumentError, match=r"epx.torch.route: capacity_factor=0.5 "
                                                       r"with capacity_mode=0"):
        et.route(logits, top_k=1, capacity_factor=0.5, capacity_mode=0)
    with pytest.raises(epx.InvalidArgumentError, match=r"epx.route_capacity: capacity_factor"):
        epx.route_capacity(40, num_experts=4, capacity_factor=0.5, capacity_mode=0)


H, E, K = 16, 4, 2


def routing(T, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, generator=g) + 0.1
    return x, idx, w / w.sum(1, keepdim=True)


def ll_buffer(comm):
    return et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=8,
                          dtype=torch.float32, low_latency=1)


def test_ll_refuses_inputs_that_require_grad():
    """The low-latency path has no backward: an input that wants a gradient
    is refused with the fix, not cut silently from the graph."""
    x, idx, w = routing(4)
    with epx.Comm.create_self() as comm, ll_buffer(comm) as b:
        for name, args in (("x", (x.requires_grad_(), idx, w)),
                           ("topk_w", (x.detach(), idx, w.requires_grad_()))):
            with pytest.raises(epx.InvalidArgumentError, match=r"ll_dispatch: %s requires grad.*"
                               r"no backward.*torch.no_grad\(\)" % name):
                et.ll_dispatch(b, *args)
        with torch.no_grad():
            recv_x, _, handle, _ = et.ll_dispatch(b, x, idx, w)
        with pytest.raises(epx.InvalidArgumentError, match=r"ll_combine: x requires grad"):
            et.ll_combine(b, recv_x.requires_grad_(), handle)
        handle.release()


@pytest.mark.parametrize("count", [torch.tensor([], dtype=torch.int32),
                                   torch.tensor([1, 2], dtype=torch.int32)])
def test_ll_num_tokens_of_the_wrong_size_is_named(count):
    x, idx, w = routing(4)
    with epx.Comm.create_self() as comm, ll_buffer(comm) as b:
        with pytest.raises(epx.InvalidArgumentError, match=r"ll_dispatch: num_tokens is a tensor "
                           r"of %d elements.*one element" % count.numel()):
            et.ll_dispatch(b, x, idx, w, num_tokens=count)


def normal_buffer(comm):
    return et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=8)


def test_dispatch_and_combine_refuse_meta_tensors():
    """A meta tensor reached the ops' fake functions and came back as meta
    outputs, as if dispatched; it is refused by name (torch.compile's fake
    tensors still trace: test_torch.py's compile tests)."""
    x, idx, w = routing(4)
    meta = torch.device("meta")
    with epx.Comm.create_self() as comm, normal_buffer(comm) as b:
        for name, args in (("x", (x.to(meta), idx, w)), ("topk_idx", (x, idx.to(meta), w)),
                           ("topk_w", (x, idx, w.to(meta)))):
            with pytest.raises(epx.InvalidArgumentError, match=r"epx.torch.dispatch: %s is a meta "
                               r"tensor" % name):
                et.dispatch(b, *args)
        d = et.dispatch(b, x, idx, w)
        with pytest.raises(epx.InvalidArgumentError, match=r"combine: expert_out is a meta tensor"):
            et.combine(d, d.recv_x.to(meta))
        del d


def test_unpack_before_check_sites_name_the_argument():
    """Shapes and types checked before they are unpacked: each error names
    the argument and the form expected."""
    x, idx, w = routing(4)
    with epx.Comm.create_self() as comm, normal_buffer(comm) as b:
        with pytest.raises(epx.InvalidArgumentError, match=r"dispatch: topk_idx has shape \[4\]; "
                                                           r"pass \[T, K\]"):
            et.dispatch(b, x, idx[:, 0], w[:, 0])
        for d in ("x", (1, 2), None):
            with pytest.raises(TypeError, match=r"combine: d is a %s; pass the Dispatched"
                               % type(d).__name__):
                et.combine(d, x)
    with pytest.raises(epx.InvalidArgumentError, match=r"epx.torch.route: logits has shape \[4\]; "
                                                       r"pass \[T, E\]"):
        et.route(torch.zeros(4), top_k=1)
    with pytest.raises(epx.InvalidArgumentError, match=r"quantize: x has shape \[128\]"):
        epx.quantize(np.zeros(128, np.float32), epx.FP8Format(0))
    with pytest.raises(epx.InvalidArgumentError, match=r"dequantize: x_q has shape \[128\]"):
        epx.dequantize(np.zeros(128, np.uint8), np.zeros(1, np.float32), epx.FP8Format(0))


def nemo_step(comm, T, seed):
    """epx.nemo's dispatch and combine of T tokens on this rank, the experts
    the identity: each token comes back times the ranks it went to."""
    import epx.nemo as en
    x, idx, w = routing(T, seed + comm.rank)
    recv_x, _, _, _, handle = en.fused_dispatch(x, idx, w, E, comm)
    out, _ = en.fused_combine(recv_x, comm, handle)
    ranks = torch.tensor([len(set((row // (E // comm.size)).tolist())) for row in idx])
    torch.testing.assert_close(out, x * ranks[:, None].to(x.dtype))


def test_dropin_buffers_grow_together_from_an_empty_first_batch():
    """A first batch empty on every rank sized the buffer to 0 tokens and
    refused every later one (naming a make_buffer call the user never
    made); a larger batch on one rank was refused. Now the buffer grows, on
    every rank together (the layout refuses an oversize batch on all of
    them at once)."""
    import epx.nemo as en

    def run(comm):
        nemo_step(comm, 0, SEED)
        nemo_step(comm, 5, SEED)
        nemo_step(comm, [3, 40][comm.rank], SEED + 1)  # rank 1 alone outgrows it
        nemo_step(comm, 0, SEED)
        return [b.dropin_max_tokens for key, b in en._buffers._buffers.items()
                if key[0] == id(comm)]
    try:
        assert epx.run_local(2, run, timeout_seconds=20) == [[40], [40]]
    finally:
        en.close()


def test_dropin_fixed_size_refusal_names_the_dropins_setting():
    import epx.nemo as en

    def run(comm):
        nemo_step(comm, 4, SEED)
        with pytest.raises(epx.CapacityExceededError, match=r"a rank has 9 tokens, above the 6.*"
                           r"epx.nemo.configure\(max_tokens_per_rank=9\)"):
            nemo_step(comm, [2, 9][comm.rank], SEED)
        nemo_step(comm, 6, SEED)  # the comm and buffer still work
        return True
    en.configure(max_tokens_per_rank=6)
    try:
        assert epx.run_local(2, run, timeout_seconds=20) == [True, True]
    finally:
        en.configure(max_tokens_per_rank=0)
        en.close()


ONE_RANK_CALLS = """
import os, sys, time, torch.distributed as dist, epx, epx.torch as et
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
if rank == 0:
    t = time.time()
    try:
        et.comm_from_process_group(timeout_seconds=2)
        print("no error")
    except epx.TimeoutError as e:
        print("timeout", round(time.time() - t), e.message)
    sys.stdout.flush()
    os._exit(0)  # not torch's exit, which waits for the other rank
else:
    time.sleep(60)  # alive, but never calling
"""


def test_comm_from_process_group_on_one_rank_only_times_out(tmp_path):
    """A gloo all_gather_object waited forever for a rank that never called;
    the exchange is now bounded by timeout_seconds and names the rank."""
    import os
    import subprocess
    env = dict(os.environ, EPX_LIBRARY=epx.library_path,
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "WORLD_SIZE"):
        env.pop(v, None)
    args = [sys.executable, "-c", ONE_RANK_CALLS]
    store = str(tmp_path / "store")
    procs = [subprocess.Popen(args + [str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=45)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    words = out.split()
    assert words[:1] == ["timeout"] and int(words[1]) <= 20, out + err  # 2 s, on a busy machine
    assert "group rank(s) 1 of 2 did not arrive within 2 s" in out, out


def test_an_outgrown_buffer_serves_its_pending_backward():
    """Two forwards, then one backward over both (DESIGN.md's lesson): the
    second forward grows the buffer, and the first one's backward still
    replays its handles on the outgrown buffer, closed once they are gone."""
    import gc
    import epx.nemo as en
    comm = epx.Comm.create_self()
    try:
        outs = []
        for T in (4, 40):
            x, idx, w = routing(T)
            x.requires_grad_(True)
            recv_x, _, _, _, handle = en.fused_dispatch(x, idx, w, E, comm)
            outs.append((x, en.fused_combine(recv_x * 3, comm, handle)[0]))
            del handle, recv_x
        assert len(en._buffers._outgrown) == 1
        sum(out.sum() for _, out in outs).backward()
        for x, _ in outs:
            torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
        del outs
        gc.collect()
        en.close()
        assert not en._buffers._buffers and not en._buffers._outgrown
    finally:
        en.close()
        comm.close()
