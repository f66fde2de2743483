"""The CUDA-event timing the PyTorch benchmarks beside epx share
(bench_torch_ep.py under mpirun, bench_torch_layer.py): both import it from
this folder, which Python puts first on sys.path when it runs either script
by its path (python3 bench/gpu/<script>.py, mpirun included)."""
import torch


def median_ms(fn, reps=20, warm=3, barrier=None):
    """Median CUDA-event time in ms of fn over reps calls, after warm calls
    and a synchronisation (barrier: called then, so that ranks start the
    timed calls together). Each call is timed between the events recorded
    around it on the current stream, all of them read after one final
    synchronisation."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))[reps // 2]
