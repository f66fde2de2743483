"""Random bad input through the Python layer (epx and epx.torch), as a
careless PyTorch user would pass it: wrong shapes, dtypes, devices, strides,
row counts, ids out of range or of the wrong dtype, ints past their C type,
NaNs, handles misused. CI runs it under an AddressSanitizer build of the
library (LD_PRELOAD of libasan, EPX_LIBRARY pointing at it), beside the C
fuzzers in this directory.

What must hold, for every call:
  - it either succeeds or raises an epx.EpxError, TypeError or ValueError
    (epx's refusals are EpxErrors; the few a Python check makes before them
    are TypeError / ValueError) -- never another exception, and never a
    crash or a sanitizer report (the process dies then);
  - a call that succeeds gives what the valid call gives: routing ids in
    [-1, E), combine(dispatch(x)) equal to sum_k w * x for identity experts.

    EPX_LIBRARY=build-asan/libepx.so PYTHONPATH=python \\
        python tests/fuzz/fuzz_python.py [--seconds S] [--seed N] [--count N]

runs cases seed, seed + 1, ... until S seconds or N cases, prints one line of
counts, and exits 1 at the first finding with its seed (re-run it alone with
--seed N --count 1).
"""
import argparse
import gc
import pathlib
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import epx  # noqa: E402
import epx.torch as et  # noqa: E402

ALLOWED = (epx.EpxError, TypeError, ValueError)
torch.set_num_threads(1)

# Integers a careless caller passes where a small count belongs.
WILD_INTS = (0, 1, 2, 3, 4, -1, -3, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 32 + 4, -2 ** 31 - 1,
             2 ** 63, 2 ** 64 + 16, -2 ** 63 - 1)


class Case:
    """One seeded case: a random generator and the draws it made."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.seed = seed

    def chance(self, p):
        return self.rng.random() < p

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def count(self, valid, int64=False, small=False):
        """Mostly `valid`, sometimes a wild int (int64: one that fits int64_t,
        for the custom ops called directly, whose schema refuses the rest in
        torch's words; small: none that is a valid but huge size, which a
        buffer would really try to allocate)."""
        wild = [v for v in WILD_INTS if (not int64 or -2 ** 63 <= v < 2 ** 63)
                and (not small or v <= 4 or v >= 2 ** 63)]
        return valid if self.chance(0.8) else self.pick(wild)


# ---------------------------------------------------------------------------
# Bad versions of a tensor
# ---------------------------------------------------------------------------


def mangle(c, t, *, rows=True, dtype=True, tensor=False):
    """t, or a bad version of it: fewer or more rows, another dtype, a
    transposed or strided view, another rank, a list, None, NaNs (tensor:
    always a tensor, for the custom ops called directly, whose schema
    refuses the rest in torch's words)."""
    if c.chance(0.55):
        return t
    kinds = ("rows", "dtype", "stride", "ndim", "nan", "empty")
    kinds += () if tensor else ("list", "none")
    kind = c.pick(kinds)
    if kind == "rows" and rows and t.dim() >= 1:
        n = t.shape[0]
        new = max(0, n + int(c.rng.integers(-n - 1, 3)))
        if new <= n:
            return t[:new]
        return torch.cat([t, t[:new - n]]) if n else t
    if kind == "dtype" and dtype:
        return t.to(c.pick((torch.float64, torch.float16, torch.bfloat16, torch.int64,
                            torch.int32, torch.uint8, torch.bool)))
    if kind == "stride" and t.dim() == 2 and t.shape[0] > 1:
        return torch.cat([t, t]).view(2, *t.shape).transpose(0, 1)[:, 0] if c.chance(0.5) \
            else t.t().contiguous().t()
    if kind == "ndim":
        return t.reshape(-1) if c.chance(0.5) else t.unsqueeze(0)
    if kind == "list":
        return t.tolist()
    if kind == "none":
        return None
    if kind == "nan" and t.is_floating_point() and t.numel():
        t = t.clone()
        t.view(-1)[int(c.rng.integers(t.numel()))] = float("nan")
        return t
    if kind == "empty":
        return t[:0]
    return t


def np_of(t):
    """A mangled tensor as the numpy layer's argument (bfloat16 has no numpy
    dtype: it stays a tensor, which that layer refuses)."""
    return t.numpy() if isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16 else t


def wild_ids(c, idx, E):
    """topk_idx with ids out of range, of a wider or a non-integer dtype."""
    if c.chance(0.5):
        return mangle(c, idx)
    idx = idx.long().clone()
    if idx.numel():
        idx.view(-1)[int(c.rng.integers(idx.numel()))] = c.pick((E, -2, 2 ** 32 + 1, -2 ** 40,
                                                                  2 ** 31))
    return idx if c.chance(0.7) else idx.to(c.pick((torch.float32, torch.float64, torch.bool)))


# ---------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------


def route_fields(c, E, K):
    fields = dict(top_k=c.count(K))
    if c.chance(0.3):
        fields["num_experts"] = c.count(E)
    if c.chance(0.3):
        fields.update(capacity_mode=1, capacity_factor=c.pick((1.0, 1.2, 0.0, -1.0, 1e30,
                                                                float("nan"))),
                      min_capacity=c.count(0))
    if c.chance(0.2):
        fields.update(renormalize=c.pick((0, 1, 2)), renormalize_after_drop=c.pick((0, 1)))
    if c.chance(0.2):
        fields.update(aux_loss_coeff=float(c.rng.random()), aux_loss_tokens=c.count(8) + 0.5)
    if c.chance(0.1):
        fields["random_seed"] = c.pick((0, -1, 2 ** 64, 2 ** 64 - 1))
    if c.chance(0.1):
        fields["score_fn"] = c.pick((0, 1, 2, 3, 7, -1))
    return fields


def check_route(r, E):
    idx = r.topk_idx if isinstance(r.topk_idx, np.ndarray) else r.topk_idx.numpy()
    assert ((idx >= -1) & (idx < E)).all(), "route gave ids outside [-1, %d): %s" % (E, idx)


def call_route(c):
    T, E = int(c.rng.integers(0, 12)), int(c.rng.integers(1, 9))
    K = int(c.rng.integers(1, E + 1))
    logits = torch.randn(T, E)
    fields = route_fields(c, E, K)
    which = c.pick(("numpy", "reference", "torch", "backward", "capacity"))
    if which == "capacity":
        return epx.route_capacity(c.count(T), **fields)
    if which == "torch":
        x = mangle(c, logits)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().requires_grad_(c.chance(0.5))
        r = et.route(x, **fields)
        if r.topk_w.requires_grad:
            (r.topk_w.sum() + r.aux_loss).backward()
        return check_route(r, r.expert_counts.shape[0])
    arr = np_of(mangle(c, logits))
    fn = {"numpy": epx.route, "reference": epx.reference_route}.get(which)
    if fn is not None:
        r = fn(arr, **fields)
        return check_route(r, len(r.expert_counts))
    r = epx.route(logits.numpy(), **fields)
    g = np_of(mangle(c, torch.randn(T, int(r.config.top_k))))
    epx.route_backward(logits.numpy(), r, g)


def close(obj):
    """Closes a buffer or dispatcher once the call's outputs are gone (a
    garbage collection first where a reference cycle still holds them)."""
    try:
        obj.close()
    except epx.BusyError:
        gc.collect()
        obj.close()


def torch_layer_step(c, comm, T, H, E, K):
    """One dispatch and combine with some arguments mangled; checks the
    result when every call succeeded with the valid arguments."""
    buf = et.make_buffer(comm, hidden=H, num_experts=E, max_top_k=K, max_tokens_per_rank=T)
    try:
        x = torch.randn(T, H)
        r = et.route(torch.randn(T, E), top_k=K)
        idx, w = wild_ids(c, r.topk_idx, E), mangle(c, r.topk_w)
        xin = mangle(c, x)
        d = et.dispatch(buf, xin, idx, w)
        eo = mangle(c, d.recv_x)
        if c.chance(0.1):
            d = d._replace(num_tokens=c.count(T, True))
        out = et.combine(d, eo)
        if xin is x and idx is r.topk_idx and w is r.topk_w and eo is d.recv_x and \
                d.num_tokens == T:
            ref = (r.topk_w.unsqueeze(-1) * x.unsqueeze(1) * (r.topk_idx >= 0).unsqueeze(-1)).sum(1)
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), "combine(dispatch(x)) is wrong"
        if c.chance(0.3):
            ops = torch.ops.epx
            rows = d.recv_x.shape[0]
            pick = c.pick(("dispatch_backward", "combine_backward", "weights_backward"))
            if pick == "dispatch_backward":
                ops.dispatch_backward(mangle(c, d.recv_x, tensor=True), None, d.handle_id,
                                      c.count(T, True), K)
            elif pick == "combine_backward":
                ops.combine_backward(mangle(c, out, tensor=True), None, d.handle_id,
                                     c.count(rows, True), K)
            else:
                ops.weights_backward(mangle(c, d.recv_w, tensor=True), d.handle_id,
                                     c.count(T, True), K)
        del d, out
    finally:
        close(buf)


def call_torch_layer(c):
    T, H = int(c.rng.integers(1, 10)), 8 * int(c.rng.integers(1, 4))
    E = c.pick((2, 4, 8))
    K = int(c.rng.integers(1, min(E, 3) + 1))
    if c.chance(0.15):
        # two ranks: one's refusal must fail the other at once, not hang it
        def rank_main(comm):
            sub = Case(c.seed * 2 + comm.rank)
            torch_layer_step(sub, comm, T, H, E, K)
        epx.run_local(2, rank_main, timeout_seconds=3)
        return
    with epx.Comm.create_self() as comm:
        torch_layer_step(c, comm, T, H, E, K)


def call_numpy_buffer(c):
    T, H, E = int(c.rng.integers(1, 10)), 16, 4
    K = int(c.rng.integers(1, 3))
    fields = dict(hidden=c.count(H, small=True), num_experts=c.count(E, small=True),
                  max_top_k=c.count(K, small=True), max_tokens_per_rank=c.count(T, small=True))
    with epx.Comm.create_self() as comm, comm.buffer(**fields) as buf:
        r = epx.route(np.random.default_rng(c.seed).standard_normal((T, E)).astype(np.float32),
                      top_k=K)
        idx = np_of(wild_ids(c, torch.from_numpy(r.topk_idx), E))
        with buf.dispatch_layout(idx, r.topk_w) as h:
            x = epx.empty((T, H))
            x[:] = 1.0
            recv = buf.dispatch(h, np_of(mangle(c, torch.from_numpy(x))))
            buf.combine(h, np_of(mangle(c, torch.from_numpy(recv))))


def call_worlds(c):
    """A one-rank world (a bigger one would wait for its other ranks)."""
    with epx.LocalWorld(c.count(1, small=True), timeout_seconds=0.2) as world:
        world.comm(c.count(0)).close()


def call_token_dispatcher(c):
    T, H, E, K = int(c.rng.integers(1, 9)), 16, 4, 2
    with epx.Comm.create_self() as comm:
        disp = et.TokenDispatcher(comm, E, H, K, max_tokens_per_rank=T)
        try:
            scores = torch.softmax(torch.randn(T, E), 1)
            routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(
                1, scores.topk(K, 1).indices, True)
            rows, _ = disp.token_permutation(mangle(c, torch.randn(T, H)),
                                             mangle(c, scores * routing_map, rows=False),
                                             mangle(c, routing_map))
            disp.token_unpermutation(mangle(c, rows))
        finally:
            close(disp)


CALLS = (call_route, call_route, call_torch_layer, call_torch_layer, call_numpy_buffer,
         call_worlds, call_token_dispatcher)


def run_case(seed):
    """'ok', 'refused', or raises AssertionError with the finding."""
    c = Case(seed)
    call = c.pick(CALLS)
    try:
        call(c)
        return "ok"
    except ALLOWED:
        return "refused"
    except BaseException as e:  # noqa: B902  (anything else is the finding)
        raise AssertionError("seed %d (%s): %s: %s\n%s" % (seed, call.__name__, type(e).__name__,
                                                           e, traceback.format_exc())) from e


def main():
    gc.freeze()  # torch's objects: a collection then looks at the cases' own only
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=0)
    args = parser.parse_args()
    counts = {"ok": 0, "refused": 0}
    start, seed = time.monotonic(), args.seed
    while time.monotonic() - start < args.seconds and (not args.count or
                                                        sum(counts.values()) < args.count):
        try:
            counts[run_case(seed)] += 1
        except AssertionError as e:
            text = str(e)
            print("fuzz_python: FINDING: %s" % (text if len(text) < 4000 else
                                               text[:1500] + " ... " + text[-2500:]), flush=True)
            return 1
        seed += 1
    print("fuzz_python: %d cases (seeds %d..%d) in %.0f s: %d ok, %d refused, no finding" % (
        sum(counts.values()), args.seed, seed - 1, time.monotonic() - start, counts["ok"],
        counts["refused"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
