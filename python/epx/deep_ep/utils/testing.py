"""The timing helpers DeepEP's tests import from ``deep_ep.utils.testing``:
wall-clock timings of a call (epx's kernels have names of their own, so
bench_kineto reports the call's time under every kernel name asked for)."""
import time

import torch
import torch.distributed as dist


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def bench(fn, num_warmups: int = 50, num_tests: int = 50, post_fn=None):
    """(mean, min, max) seconds of fn() over num_tests calls after warm-up."""
    for _ in range(num_warmups):
        fn()
    _sync()
    times = []
    for _ in range(num_tests):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
        if post_fn is not None:
            post_fn()
    times = sorted(times)[1:] if len(times) > 1 else times
    return sum(times) / len(times), min(times), max(times)


def bench_kineto(fn, kernel_names, num_tests: int = 30, suppress_kineto_output: bool = False,
                 trace_path=None, barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1, barrier=None, **kwargs):
    """The mean seconds of fn() for each name in kernel_names (a name or a
    tuple of names: a float or a tuple of floats)."""
    for _ in range(3):
        fn()
    if barrier_comm_profiling:
        if barrier is not None:
            barrier()
        elif dist.is_initialized():
            dist.barrier()
    _sync()
    t0 = time.perf_counter()
    for _ in range(num_tests):
        fn()
    _sync()
    t = (time.perf_counter() - t0) / num_tests
    if isinstance(kernel_names, str):
        return t
    return tuple(t for _ in kernel_names)


class empty_suppress:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


suppress_stdout_stderr = empty_suppress
