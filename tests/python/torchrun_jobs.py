"""Runs a test script's worker as a CPU job of W processes under torchrun
(gloo; epx's comm from the group through shared memory, no MPI), as the
drop-ins' users launch them. The worker prints "rank <r> OK" last."""
import os
import pathlib
import re
import socket
import subprocess
import sys

import epx


# A process can abort at interpreter exit after its work is done: "terminate
# called without an active exception", a C++ thread of PyTorch's gloo
# teardown still joinable (pytorch/pytorch#190489; seen in CI in DeepSpeed's
# job after both ranks said OK). epx is C and cannot raise it. A job whose
# every rank said OK and that ended only so is run once more.
_EXIT_ABORT = "terminate called without an active exception"


def _run(W, script, args, timeout, env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(W),
               "--master-addr", "127.0.0.1", "--master-port", str(port), script] + list(args)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def _ranks_ok(run):
    # The ranks share one stdout pipe, so two ranks' lines can run together.
    return sorted(int(r) for r in re.findall(r"rank (\d+) OK", run.stdout))


def torchrun(W, script, *args, timeout=300, env=None):
    """torchrun --nproc-per-node W script args (env: variables added to
    this process's); asserts every rank said OK."""
    env = dict(os.environ, EPX_LIBRARY=epx.library_path, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(epx.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]), **(env or {}))
    run = _run(W, script, args, timeout, env)
    if run.returncode != 0 and _ranks_ok(run) == list(range(W)) and _EXIT_ABORT in run.stderr:
        run = _run(W, script, args, timeout, env)
    assert run.returncode == 0, "torchrun failed:\n%s\n%s" % (run.stdout[-3000:],
                                                             run.stderr[-6000:])
    assert _ranks_ok(run) == list(range(W)), run.stdout + run.stderr[-3000:]
