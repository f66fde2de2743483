"""epx.torch's checks and small conveniences: inputs that used to give
silent wrong output now raise a clear exception (MoE.forward's hidden size,
dtype and device; TokenDispatcher's routing_map rows with more than top_k
experts and selected experts without a probability), MoE's seeded init is
per rank (global expert e starts the same whatever the rank count), ranks as
threads draw reproducibly without a generator, and MoE returns its expert
counts. The README's single-process snippet runs as written.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_torch_checks.py
"""
import pathlib
import re
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(HERE))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from test_epx import SEED, TIMEOUT  # noqa: E402

H, F, E, K, T = 16, 8, 8, 2, 12
torch.set_num_threads(1)


def layer(comm, **kw):
    return et.MoE(comm, H, F, E, K, max_tokens_per_rank=32, **kw)


def test_moe_forward_refuses_a_wrong_hidden_size_dtype_or_shape():
    with epx.Comm.create_self() as comm:
        m = layer(comm, generator=torch.Generator().manual_seed(SEED))
        for shape in ((16, 17), (32, 17), (4, 4, 15)):
            with pytest.raises(epx.InvalidArgumentError, match=r"the layer's hidden size is 16"):
                m(torch.randn(*shape))
        with pytest.raises(epx.InvalidArgumentError, match=r"x is torch.float64 but the layer's "
                                                           r"experts are torch.float32"):
            m(torch.randn(4, H, dtype=torch.float64))
        with pytest.raises(TypeError, match="x is a list"):
            m([[0.0] * H])
        assert m(torch.randn(3, 5, H)).shape == (3, 5, H)
        m.buffer.close()


def test_moe_returns_its_expert_counts():
    with epx.Comm.create_self() as comm:
        m = layer(comm, generator=torch.Generator().manual_seed(SEED))
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(SEED + 1))
        out, counts = m(x, return_counts=True)
        assert out.shape == (T, H) and counts.shape == (E,)
        r = et.route(torch.nn.functional.linear(x, m.router.weight), top_k=K)
        want = torch.bincount(r.topk_idx.long().flatten(), minlength=E)
        assert torch.equal(counts.long(), want) and int(counts.sum()) == T * K
        assert m.expert_counts is counts
        assert int(m.tokens_per_expert.sum()) == T * K  # one rank: every route lands here
        del out
        m.aux_loss = None
        m.buffer.close()


def test_moe_generator_gives_each_rank_its_own_experts():
    """W=2 with the same seed: rank r holds experts [r*E/2, (r+1)*E/2) of the
    one-rank layer's weights, and the router is the same everywhere."""
    def weights(comm):
        m = layer(comm, generator=torch.Generator().manual_seed(SEED))
        out = (m.router.weight.detach().clone(), m.w_gate_up.detach().clone(),
               m.w_down.detach().clone())
        m.buffer.close()
        return out
    (one,) = epx.run_local(1, weights, timeout_seconds=TIMEOUT)
    two = epx.run_local(2, weights, timeout_seconds=TIMEOUT)
    half = E // 2
    for r in range(2):
        assert torch.equal(two[r][0], one[0])
        assert torch.equal(two[r][1], one[1][r * half:(r + 1) * half])
        assert torch.equal(two[r][2], one[2][r * half:(r + 1) * half])
    assert not torch.equal(two[0][1], two[1][1])


def test_ranks_as_threads_draw_reproducibly_without_a_generator():
    def weights(comm):
        m = layer(comm)
        out = m.w_gate_up.detach().clone()
        m.buffer.close()
        return out
    torch.manual_seed(SEED)
    a = epx.run_local(2, weights, timeout_seconds=TIMEOUT)
    torch.manual_seed(SEED)
    b = epx.run_local(2, weights, timeout_seconds=TIMEOUT)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], a[1])


def megatron_routing(seed, T=T):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    probs_k, idx = torch.topk(torch.softmax(logits, -1), K, dim=1)
    probs = torch.zeros(T, E).scatter(1, idx, probs_k)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    return torch.randn(T, H, generator=g), probs, routing_map


def test_token_dispatcher_refuses_rows_beyond_top_k_and_probs_that_disagree():
    with epx.Comm.create_self() as comm:
        td = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T)
        x, probs, routing_map = megatron_routing(SEED)
        bad = routing_map.clone()
        bad[5] = True
        with pytest.raises(epx.InvalidArgumentError,
                           match=r"routing_map row 5 selects 8 experts but top_k is 2"):
            td.token_permutation(x, probs, bad)
        other = megatron_routing(SEED + 7)[1]   # sparse probs of another routing
        t, e = (int(v) for v in (routing_map & (other == 0)).nonzero()[0])
        with pytest.raises(epx.InvalidArgumentError,
                           match=r"routing_map\[%d, %d\] selects expert %d but probs\[%d, %d\] "
                           r"is 0" % (t, e, e, t, e)):
            td.token_permutation(x, other, routing_map)
        nan = probs.clone()
        nan[2] = float("nan")
        with pytest.raises(epx.InvalidArgumentError, match=r"probs\[2, \d\] is nan"):
            td.token_permutation(x, nan, routing_map)
        with pytest.raises(epx.InvalidArgumentError, match="hidden_states is torch.float64"):
            td.token_permutation(x.double(), probs, routing_map)
        tokens, counts = td.token_permutation(x, probs, routing_map)
        assert int(counts.sum()) == T * K
        out = td.token_unpermutation(tokens)[0]
        assert torch.allclose(out, x * probs.sum(1, keepdim=True), atol=1e-6)
        td.close()


def test_token_dispatcher_exact_size_returns_the_received_rows_only():
    with epx.Comm.create_self() as comm:
        worst = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T)
        exact = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T, exact_size=True)
        x, probs, routing_map = megatron_routing(SEED + 2)
        a, ca = worst.token_permutation(x, probs, routing_map)
        b, cb = exact.token_permutation(x, probs, routing_map)
        assert b.shape == (T * K, H) and a.shape[0] >= b.shape[0]
        assert torch.equal(a[:T * K], b) and torch.equal(ca, cb)
        assert torch.equal(worst.token_unpermutation(a)[0], exact.token_unpermutation(b)[0])
        worst.close()
        exact.close()


def test_readme_single_process_snippet_runs():
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- single-process snippet -->\n```python\n(.*?)```", text, re.S)
    assert m, "README lost its single-process snippet"
    scope = {}
    exec(compile(m.group(1), "README.md", "exec"), scope)
    assert scope["out"].shape == scope["x"].shape
