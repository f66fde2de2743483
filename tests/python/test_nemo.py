"""epx.nemo's fused_dispatch / fused_combine (NeMo Automodel's DeepEP
functions) against a pure-PyTorch reference of DeepEP's normal-mode
semantics, written from deep_ep's dispatch and combine: rows by source rank
then token, one per (token, rank) the token chose an expert on; local
expert ids, -1 and weight 0 elsewhere; received tokens per local expert;
combine the sum of each token's rows. Outputs and the gradients of x and of
token_probs, on 1 rank (a gloo group of one), 2 and 4 ranks (threads of
the local transport) and 2 processes under torchrun (a gloo group); the
recompute under NeMo's own dispatch-replay recorder. epx.nemo runs on
epx.deep_ep's Buffer; NeMo Automodel's layer itself, through
epx.deep_ep.install(), is tested in test_deep_ep_frameworks.py. install()
is checked on stand-in modules.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_nemo.py
"""
import gc
import pathlib
import sys
import types

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import epx  # noqa: E402
import epx.nemo as en  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402
from torchrun_jobs import torchrun  # noqa: E402

torch.set_num_threads(1)
H = 8


def world(seed, W, T, E, K, drop=0.25, uneven=False):
    """Every rank's x [T, H], token_indices [T, K] (distinct experts, a
    fraction `drop` of them -1), token_probs, and the output's gradient;
    T + r tokens on rank r when uneven."""
    g = torch.Generator().manual_seed(seed)
    ranks = []
    for r in range(W):
        n = T + r if uneven else T
        idx = torch.argsort(torch.rand(n, E, generator=g), dim=1)[:, :K]
        idx = torch.where(torch.rand(n, K, generator=g) < drop, -1, idx)
        probs = torch.rand(n, K, generator=g) * (idx >= 0)
        ranks.append(dict(x=torch.randn(n, H, generator=g), idx=idx, probs=probs,
                          grad=torch.randn(n, H, generator=g)))
    return ranks


def expert(recv_x, local, probs):
    """Each row times 1 + sum over its local experts e of probs * (e + 1)."""
    scale = 1.0 + (probs * (local + 1).clamp(min=0).to(probs.dtype)).sum(1)
    return recv_x * scale[:, None]


def reference(ranks, E):
    """DeepEP's semantics in plain PyTorch, the whole world at once: per rank
    r its (recv_x, local ids, probs, tokens_per_expert) and every rank's
    output; the gradients of x and probs per rank."""
    W = len(ranks)
    El = E // W
    xs = [r["x"].clone().requires_grad_(True) for r in ranks]
    ps = [r["probs"].clone().requires_grad_(True) for r in ranks]
    outs = [torch.zeros_like(r["x"]) for r in ranks]
    received = []
    for r in range(W):
        rows, local, probs, src = [], [], [], []
        for s, rank in enumerate(ranks):
            mine = (rank["idx"] >= r * El) & (rank["idx"] < (r + 1) * El)
            for t in torch.nonzero(mine.any(1)).flatten().tolist():
                rows.append(xs[s][t])
                local.append(torch.where(mine[t], rank["idx"][t] - r * El, -1))
                probs.append(ps[s][t] * mine[t])
                src.append((s, t))
        recv_x = torch.stack(rows) if rows else torch.zeros(0, H)
        local = torch.stack(local) if local else torch.zeros(0, ranks[0]["idx"].shape[1],
                                                             dtype=torch.int64)
        probs = torch.stack(probs) if probs else torch.zeros(local.shape)
        counts = torch.stack([(local == e).sum() for e in range(El)])
        y = expert(recv_x, local, probs)
        for i, (s, t) in enumerate(src):
            outs[s] = outs[s].index_add(0, torch.tensor([t]), y[i:i + 1])
        received.append((recv_x.detach(), local, probs.detach(), counts))
    sum((o * rank["grad"]).sum() for o, rank in zip(outs, ranks)).backward()
    return received, [o.detach() for o in outs], [x.grad for x in xs], [p.grad for p in ps]


def rank_step(group, rank, E):
    x = rank["x"].clone().requires_grad_(True)
    probs = rank["probs"].clone().requires_grad_(True)
    recv_x, local, recv_probs, tokens_per_expert, handle = en.fused_dispatch(
        x, rank["idx"], probs, E, group)
    out, none = en.fused_combine(expert(recv_x, local, recv_probs), group, handle)
    (out * rank["grad"]).sum().backward()
    return dict(recv=(recv_x.detach(), local, recv_probs.detach(), tokens_per_expert),
                out=out.detach(), none=none, x=x.grad, probs=probs.grad)


def check(got, ref, r):
    (recv_x, local, probs, counts), (rx, rl, rp, rc) = got["recv"], ref[0][r]
    assert local.dtype == torch.int64 and counts.dtype == torch.int64
    assert counts.device.type == "cpu" and got["none"] is None
    assert torch.equal(recv_x, rx) and torch.equal(local, rl), "rank %d rows" % r
    assert torch.equal(probs, rp) and torch.equal(counts, rc), "rank %d probs/counts" % r
    for name, want in (("out", ref[1][r]), ("x", ref[2][r]), ("probs", ref[3][r])):
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-5,
                                   msg=lambda m: "rank %d %s: %s [EPX_TEST_SEED=%d]" % (
                                       r, name, m, SEED))


@pytest.mark.parametrize("W,E,K", [(2, 8, 2), (2, 4, 3), (4, 8, 4)])
def test_matches_deepeps_semantics_on_ranks_of_threads(W, E, K):
    ranks = world(SEED + W + K, W, T=10, E=E, K=K, uneven=True)
    ref = reference(ranks, E)

    def run(comm):
        got = rank_step(comm, ranks[comm.rank], E)
        check(got, ref, comm.rank)
        return True
    try:
        assert epx.run_local(W, run, timeout_seconds=TIMEOUT) == [True] * W
    finally:
        en.close()


def test_one_rank_over_a_gloo_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    try:
        ranks = world(SEED, 1, T=12, E=4, K=2)
        ref = reference(ranks, 4)
        check(rank_step(dist.group.WORLD, ranks[0], 4), ref, 0)
        # The same group and shape reuse the comm and the buffer; more tokens
        # grow it (epx.deep_ep's Buffer, as every rank agrees the largest).
        check(rank_step(dist.group.WORLD, ranks[0], 4), ref, 0)
        big = world(SEED + 1, 1, T=40, E=4, K=2)
        check(rank_step(dist.group.WORLD, big[0], 4), reference(big, 4), 0)
        big = big[0]
        with pytest.raises(epx.InvalidArgumentError, match="float32"):
            en.fused_dispatch(big["x"], big["idx"], big["probs"].double(), 4, dist.group.WORLD)
    finally:
        en.configure(max_tokens_per_rank=0)
        en.close()
        dist.destroy_process_group()


def test_close_keeps_what_it_could_not_close(tmp_path):
    """close() with a buffer still in use (a backward not run yet) raises
    BusyError and keeps the buffer and the comm, so a second close() (after
    the backward) closes them; it used to empty its registry first, and the
    second close closed nothing."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    try:
        r = world(SEED, 1, T=6, E=4, K=2)[0]
        x = r["x"].clone().requires_grad_(True)
        recv_x, _, _, _, handle = en.fused_dispatch(x, r["idx"], r["probs"], 4, dist.group.WORLD)
        out, _ = en.fused_combine(recv_x * 2, dist.group.WORLD, handle)
        del handle
        for _ in range(2):
            with pytest.raises(epx.BusyError):
                en.close()
            assert len(en._groups) == 1
        out.sum().backward()
        del out, recv_x
        gc.collect()
        en.close()
        assert not en._groups
    finally:
        en.close()
        dist.destroy_process_group()


def test_recompute_under_nemos_replay_recorder_exchanges_no_layout(tmp_path):
    """NeMo's own DispatchReplayRecorder and dispatch_replay_scope (its
    activation-checkpoint context): the recompute's dispatch replays the
    forward's handle, no layout (counted by epx.deep_ep.stats())."""
    fa = pytest.importorskip("nemo_automodel.components.moe.megatron.fused_a2a")
    import epx.deep_ep
    from torch.utils.checkpoint import checkpoint
    ranks = world(SEED, 1, T=12, E=4, K=2)
    ref = reference(ranks, 4)
    comm = epx.Comm.create_self()

    def context_fn():
        recorder = fa.DispatchReplayRecorder()

        def scoped(mode):
            import contextlib

            @contextlib.contextmanager
            def scope():
                if mode == "replay":
                    recorder.rewind()
                with fa.dispatch_replay_scope(recorder, mode):
                    yield
            return scope()
        return scoped("record"), scoped("replay")

    try:
        x = ranks[0]["x"].clone().requires_grad_(True)
        probs = ranks[0]["probs"].clone().requires_grad_(True)

        def layer(x, probs):
            recv_x, local, recv_probs, _, handle = en.fused_dispatch(x, ranks[0]["idx"], probs, 4,
                                                                     comm)
            return en.fused_combine(expert(recv_x, local, recv_probs), comm, handle)[0]
        epx.deep_ep.stats(reset=True)
        out = checkpoint(layer, x, probs, use_reentrant=False, context_fn=context_fn)
        fwd = epx.deep_ep.stats()
        (out * ranks[0]["grad"]).sum().backward()
        st = epx.deep_ep.stats()
        assert fwd["layouts"] == 1 and st["layouts"] == 1, st
        assert st["cached_dispatches"] == 2, st   # the recompute's, combine's backward
        out = out.detach()        # the graph (and the recorder's handles) released
        torch.testing.assert_close(out, ref[1][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(x.grad, ref[2][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(probs.grad, ref[3][0], atol=1e-6, rtol=1e-5)
    finally:
        en.close()
        comm.close()


def torchrun_worker(seed):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    ranks = world(seed, W, T=10, E=8, K=3, uneven=True)
    check(rank_step(dist.group.WORLD, ranks[rank], 8), reference(ranks, 8), rank)
    en.close()
    dist.destroy_process_group()
    print("rank %d OK" % rank)


def test_two_processes_under_torchrun():
    torchrun(2, __file__, "torchrun-worker", str(SEED))


def test_install_points_nemos_functions_at_epx(monkeypatch):
    """install() rebinds fused_dispatch / fused_combine / set_deepep_num_sms
    in NeMo Automodel's fused_a2a and token_dispatcher modules (stand-ins
    here: the real ones need DeepEP)."""
    stand_ins = {}
    for name in en._NEMO_MODULES:
        m = types.ModuleType(name)
        m.fused_dispatch = m.fused_combine = None
        stand_ins[name] = m
        monkeypatch.setitem(sys.modules, name, m)
    stand_ins[en._NEMO_MODULES[0]].set_deepep_num_sms = None
    en.install()
    for m in stand_ins.values():
        assert m.fused_dispatch is en.fused_dispatch and m.fused_combine is en.fused_combine
    assert stand_ins[en._NEMO_MODULES[0]].set_deepep_num_sms is en.set_deepep_num_sms


def test_install_without_nemo_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, en._NEMO_MODULES[0], None)
    with pytest.raises(epx.UnsupportedError, match="install nemo_automodel"):
        en.install()


if __name__ == "__main__" and sys.argv[1:2] == ["torchrun-worker"]:
    torchrun_worker(int(sys.argv[2]))
