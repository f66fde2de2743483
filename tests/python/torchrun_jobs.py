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


def torchrun(W, script, *args, timeout=300, env=None):
    """torchrun --nproc-per-node W script args (env: variables added to
    this process's); asserts every rank said OK."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, EPX_LIBRARY=epx.library_path, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(epx.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]), **(env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(W),
               "--master-addr", "127.0.0.1", "--master-port", str(port), script] + list(args)
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, "torchrun failed:\n%s\n%s" % (run.stdout[-3000:],
                                                             run.stderr[-6000:])
    # The ranks share one stdout pipe, so two ranks' lines can run together.
    done = sorted(int(r) for r in re.findall(r"rank (\d+) OK", run.stdout))
    assert done == list(range(W)), run.stdout + run.stderr[-3000:]
