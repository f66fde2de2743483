"""Host syncs and torch ops per epx.deep_ep call, counted on the CPU as
they would happen on CUDA, against DeepEP's own: get_dispatch_layout and
V2 combine wait for nothing, a dispatch without num_worst_tokens waits
once (DeepEP's host read of the received counts).

A sync is a call that makes the host wait for the device on CUDA:
  - the aten ops that read a value to the host or size their output from
    the data (_local_scalar_dense: item/int/bool of a tensor; nonzero,
    masked_select, unique, repeat_interleave without output_size, bincount,
    indexing with a boolean mask),
  - Tensor.tolist (a copy to the host, then a wait),
  - the library's read of a layout's row count (epx_handle_recv_rows, which
    synchronises the stream on CUDA).
A tensor read through .numpy() is not one: on CUDA that raises, so such a
read is of host memory (a CPU-only branch, or a pinned copy already waited
for). Ops are the aten ops outside epx's own custom ops (each of those
counts as one op), views included; kernels are the ops that are not views.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_deep_ep_syncs.py
     (as a script it prints the table: python tests/python/test_deep_ep_syncs.py)
"""
import collections
import contextlib
import pathlib
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))

from epx._lib import lib  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

T, H, E, K = 128, 256, 8, 2

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
             "_unique2", "unique_consecutive", "unique_dim", "bincount", "_to_cpu"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _is_mask(t):
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class _Ops(TorchDispatchMode):
    def __init__(self, tally):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        t = self.tally
        t["ops"] += 1
        if not func.is_view:
            t["kernels"] += 1
        sync = name in _SYNC_OPS
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            sync = True
        if name in _MASK_INDEXED and len(args) > 1 and any(_is_mask(i) for i in args[1]
                                                            if i is not None):
            sync = True
        if sync:
            t["syncs"] += 1
            t["where"].append(name)
        return func(*args, **kwargs)


class _Reads(TorchFunctionMode):
    def __init__(self, tally):
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.tally["syncs"] += 1
            self.tally["where"].append("tolist")
        return func(*args, **(kwargs or {}))


class count:
    """with count() as tally: ... -> tally["ops"], ["kernels"], ["syncs"],
    ["where"] (the syncs' names) of the calls inside."""

    def __enter__(self):
        self.tally = collections.Counter()
        self.tally["where"] = []
        read = lib.epx_handle_recv_rows
        tally = self.tally

        def recv_rows(*a):
            tally["syncs"] += 1
            tally["where"].append("epx_handle_recv_rows")
            return read(*a)
        self._read = read
        lib.epx_handle_recv_rows = recv_rows
        self._modes = [_Reads(self.tally), _Ops(self.tally)]
        for m in self._modes:
            m.__enter__()
        return self.tally

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        lib.epx_handle_recv_rows = self._read


def _paths():
    """(name, call, DeepEP's syncs) of each path, on a group of one."""
    import torch.distributed as dist
    import epx.deep_ep as deep_ep
    assert dist.is_initialized(), "inventory() runs inside _group_of_one()"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    group = dist.group.WORLD
    b1 = deep_ep.Buffer(group)
    per_rank, _, per_expert, in_rank, _ = b1.get_dispatch_layout(idx, E)
    recv_x, _, _, _, h1, _ = b1.dispatch(x, num_tokens_per_rank=per_rank,
                                         is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=idx,
                                         topk_weights=w)
    eb = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    fresh2 = dict(topk_idx=idx, topk_weights=w, num_experts=E)
    ex, _, _, h2, _ = eb.dispatch(x, do_expand=True, **fresh2)
    ex4, _, _, h4, _ = eb.dispatch(x, do_expand=True, expert_alignment=4, **fresh2)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    return [
        ("V1 get_dispatch_layout", lambda: b1.get_dispatch_layout(idx, E), 0),
        ("V1 dispatch (layout)", lambda: b1.dispatch(x, **layout), 1),
        ("V1 dispatch (handle=)", lambda: b1.dispatch(x, handle=h1), 0),
        ("V1 combine", lambda: b1.combine(recv_x, h1), 0),
        ("V2 dispatch", lambda: eb.dispatch(x, **fresh2), 1),
        ("V2 dispatch (do_expand)", lambda: eb.dispatch(x, do_expand=True, **fresh2), 1),
        ("V2 dispatch (do_expand, alignment 4)",
         lambda: eb.dispatch(x, do_expand=True, expert_alignment=4, **fresh2), 1),
        ("V2 dispatch (handle=, expand)", lambda: eb.dispatch(x, handle=h2, do_expand=True), 0),
        ("V2 combine (expand)", lambda: eb.combine(ex, h2), 0),
        ("V2 combine (expand, alignment 4)", lambda: eb.combine(ex4, h4), 0),
    ]


@contextlib.contextmanager
def _group_of_one():
    """A gloo group of one through a file store (no port, and nothing left in
    os.environ for the subprocesses of later tests), destroyed after."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method="file://%s/store" % d, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def inventory():
    """[(name, ops, kernels, syncs, where, DeepEP's syncs)] of each path (a
    second call: the first may make a buffer)."""
    rows = []
    with torch.no_grad(), _group_of_one():
        for name, call, theirs in _paths():
            call()
            with count() as t:
                call()
            rows.append((name, t["ops"], t["kernels"], t["syncs"], t["where"], theirs))
    return rows


def test_no_more_host_syncs_than_deep_ep():
    for name, ops, kernels, syncs, where, theirs in inventory():
        assert syncs <= theirs, "%s: %d host syncs (%s), DeepEP has %d" % (
            name, syncs, ", ".join(where), theirs)


def test_the_counter_sees_syncs():
    t0 = torch.arange(6)
    with count() as t:
        int(t0[0])
        t0.tolist()
        t0[t0 > 2]
        t0.nonzero()
        t0.numpy()
    assert t["syncs"] == 4, t["where"]


if __name__ == "__main__":
    print("| path | ops | kernels | host syncs | DeepEP's syncs | which |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, ops, kernels, syncs, where, theirs in inventory():
        counted = collections.Counter(where)
        print("| %s | %d | %d | %d | %d | %s |" % (name, ops, kernels, syncs, theirs, ", ".join(
            "%s x%d" % (k, v) if v > 1 else k for k, v in counted.items())))
