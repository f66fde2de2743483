"""torch.distributed and launchers: an epx.Comm from a process group
(comm_from_process_group, over shm, MPI, NCCL, or shm with CUDA IPC where
processes share a GPU), launch_env (each
launcher's rank and size variables) and init_process_group."""
import ctypes
import os

import torch as _torch

import epx as _epx
from epx import _lib, Status
from epx._lib import lib
from epx.errors import _check, _invalid, _refuse


_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def _comm_config(timeout_seconds):
    return _epx.CommConfig() if timeout_seconds is None else \
        _epx.CommConfig(timeout_seconds=float(timeout_seconds))


def _nccl_comm(group, rank, size, config):
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not _epx.has_nccl():
        _refuse(Status.ERROR_UNSUPPORTED, "%s: the group is an NCCL group but this libepx "
                "(%s) has no NCCL transport; build it with -DEPX_BUILD_CUDA=ON and NCCL "
                "(pip install ./python on a machine with nvcc)", fn, _epx.library_path)
    uid = _lib.NcclUniqueId()
    if rank == 0:
        _check(lib.epx_nccl_get_unique_id(ctypes.byref(uid)))
    dev = _torch.device("cuda", _torch.cuda.current_device())
    # All 128 bytes: a c_char array's .bytes value stops at its first NUL, and
    # an ncclUniqueId has zeros inside (its socket address).
    raw = _torch.frombuffer(bytearray(ctypes.string_at(ctypes.addressof(uid), 128)), dtype=_torch.uint8)
    shared = raw.to(dev)
    dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    ctypes.memmove(ctypes.addressof(uid), bytes(shared.cpu().tolist()), 128)
    p = ctypes.c_void_p()
    _check(lib.epx_comm_create_nccl_id(ctypes.byref(uid), rank, size, ctypes.byref(config),
                                            ctypes.byref(p)))
    return _epx.Comm(p.value)


def _mpi_world_without_mpi4py(fn):
    """MPI_COMM_WORLD's handle, for an MPI the library links, found with
    ctypes (Open MPI: &ompi_mpi_comm_world; MPICH: 0x44000000), MPI
    initialised (and finalised at exit) if it was not."""
    import atexit
    import ctypes.util
    name = ctypes.util.find_library("mpi")
    if name is None:
        _refuse(Status.ERROR_UNSUPPORTED, "%s: libmpi was not found; install mpi4py "
                "(pip install mpi4py, or apt-get install python3-mpi4py)", fn)
    mpi = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    flag = ctypes.c_int(0)
    mpi.MPI_Initialized(ctypes.byref(flag))
    if not flag.value:
        provided = ctypes.c_int(0)
        if mpi.MPI_Init_thread(None, None, 3, ctypes.byref(provided)) != 0:  # MPI_THREAD_MULTIPLE
            _refuse(Status.ERROR_TRANSPORT, "%s: MPI_Init_thread failed", fn)
        atexit.register(mpi.MPI_Finalize)
    try:
        handle = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_comm_world")))
    except ValueError:
        handle = ctypes.c_int(0x44000000)  # MPICH's MPI_COMM_WORLD
    return handle


def _mpi_comm(group, rank, size, config):
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not any(v in os.environ for v in _MPI_LAUNCH_VARS):
        _refuse(Status.ERROR_UNSUPPORTED, "%s: transport 'mpi' needs processes started by "
                "mpirun; launch with `mpirun -np %d python your_script.py`, or use "
                "transport='shm' for processes of one host", fn, size)
    if not _epx.has_mpi():
        _refuse(Status.ERROR_UNSUPPORTED, "%s: this libepx (%s) was built without MPI "
                "(a CMake build has it when MPI is found at configure time; the wheel only "
                "when built with SKBUILD_CMAKE_DEFINE=EPX_BUILD_MPI=ON). Processes of one "
                "host need no MPI: transport='shm'", fn, _epx.library_path)
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None:
        world = MPI.COMM_WORLD
        if world.Get_rank() != dist.get_rank():
            _invalid("%s: torch rank %d is MPI rank %d; initialise torch.distributed with "
                     "the MPI ranks (rank=OMPI_COMM_WORLD_RANK)", fn, dist.get_rank(),
                     world.Get_rank())
        mpi_comm = world if ranks == list(range(world.Get_size())) else \
            world.Create_group(world.Get_group().Incl(ranks))
        return _epx.Comm.from_mpi(mpi_comm, config)
    world = _mpi_world_without_mpi4py(fn)
    if ranks != list(range(dist.get_world_size())):
        _refuse(Status.ERROR_UNSUPPORTED, "%s: a sub-group of the world needs mpi4py to "
                "make its MPI communicator; install mpi4py", fn)
    p = ctypes.c_void_p()
    _check(lib.epx_comm_create_mpi(ctypes.addressof(world), ctypes.byref(config),
                                        ctypes.byref(p)))
    comm = _epx.Comm(p.value)
    if comm.size != size:
        _invalid("%s: MPI_COMM_WORLD has %d ranks but the group %d; launch as many MPI "
                 "ranks as torch ranks", fn, comm.size, size)
    return comm


_GATHERS = {}  # group name -> the number of _gather_bounded calls on it so far


def _gather_bounded(group, rank, size, mine, timeout_seconds, fn):
    """Every rank's picklable `mine`, gathered within timeout_seconds through
    torch.distributed's store (a gloo all_gather_object waits forever for a
    rank that never calls): each rank writes its key and waits for the
    others'; a rank missing at the timeout is EPX_ERROR_TIMEOUT naming the
    ranks that did not arrive. Keys are numbered per group, every rank
    counting its calls in the same order."""
    import datetime
    import pickle
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    name = getattr(group, "group_name", None) or str(dist.get_global_rank(group, 0))
    seq = _GATHERS[name] = _GATHERS.get(name, 0) + 1
    key = "epx/comm_from_process_group/%s/%d/%%d" % (name, seq)
    store.set(key % rank, pickle.dumps(mine))
    keys = [key % r for r in range(size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=float(timeout_seconds)))
    except RuntimeError:  # torch's store timeout (DistStoreError derives from it)
        missing = [r for r in range(size) if not store.check([key % r])]
        _refuse(Status.ERROR_TIMEOUT, "%s: group rank(s) %s of %d did not arrive within %g s; "
                "call comm_from_process_group on every rank of the group, in the same order "
                "(or raise timeout_seconds)", fn, ", ".join(map(str, missing)) or "?", size,
                timeout_seconds)
    return [pickle.loads(store.get(k)) for k in keys]


def _shm_comm(group, rank, size, config, transport="shm"):
    """The shm transport over the group's processes: they gather their hosts
    and rank 0's fresh segment name (_gather_bounded), then meet in
    /dev/shm. transport "ipc": the same comm, for CUDA buffers."""
    import secrets
    import socket
    fn = "epx.torch.comm_from_process_group"
    mine = (socket.gethostname(), "epx-%d-%s" % (os.getpid(), secrets.token_hex(8)))
    every = _gather_bounded(group, rank, size, mine, config.timeout_seconds, fn)
    hosts = sorted({h for h, _ in every})
    if len(hosts) > 1:
        _refuse(Status.ERROR_UNSUPPORTED, "%s: the group spans %d hosts (%s); transport "
                "%r joins processes of one host only; across hosts use transport='mpi' "
                "under mpirun, or an NCCL group of one GPU a process", fn, len(hosts),
                ", ".join(hosts[:4]), transport)
    return _epx.Comm.from_shm(every[0][1], rank, size, config)


_TRANSPORTS = ("shm", "mpi", "nccl", "ipc")


def _device_key():
    """This process's GPU as (host, device id): the device's UUID where torch
    gives it, else its PCI domain, bus and device."""
    import socket
    props = _torch.cuda.get_device_properties(_torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    ident = str(uuid) if uuid is not None else "pci %s:%s:%s" % (
        getattr(props, "pci_domain_id", "?"), getattr(props, "pci_bus_id", "?"),
        getattr(props, "pci_device_id", "?"))
    return socket.gethostname(), ident


def _shared_gpu(group, rank, size, timeout_seconds, fn):
    """The first two group ranks whose processes use one GPU of one host
    (gathered through the store, bounded), or None."""
    every = _gather_bounded(group, rank, size, _device_key(), timeout_seconds, fn)
    first = {}
    for r, key in enumerate(every):
        if tuple(key) in first:
            return first[tuple(key)], r
        first[tuple(key)] = r
    return None


def _transport_of(group, rank, size, transport, timeout_seconds, fn):
    import torch.distributed as dist
    if transport is not None:
        if transport not in _TRANSPORTS:
            _invalid("%s: transport is %r; pass None (chosen from the group) or one of %s",
                     fn, transport, ", ".join(map(repr, _TRANSPORTS)))
        return transport
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): such
        # a group's processes share the GPU through CUDA IPC instead
        return "ipc" if _shared_gpu(group, rank, size, timeout_seconds, fn) else "nccl"
    return "shm" if _one_host() else "mpi"


def _one_host():
    """Whether the launcher says every process is on this host (torchrun's
    LOCAL_WORLD_SIZE, mpirun's local size); unknown counts as one host, which
    the shm transport then checks."""
    size = os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return size is None or local is None or size == local


def comm_from_process_group(group=None, *, timeout_seconds=None, transport=None):
    """An epx.Comm over the ranks of a torch.distributed process group (the
    default group when None), in one call; collective over the group. No
    rebuild and no environment mapping: the launcher (torchrun, mpirun) is
    whatever started torch.distributed.

    transport (None: chosen from the group):

    - ``"nccl"`` (NCCL groups; GPUs, one process per GPU, the current CUDA
      device set): rank 0 makes an NCCL unique id, the group broadcasts it,
      every rank creates epx's NCCL comm on its current device.
    - ``"shm"`` (CPU groups, e.g. gloo under torchrun, every process on one
      host): the processes meet in POSIX shared memory (epx_comm_create_shm),
      the segment's name passed through torch.distributed's store, within
      timeout_seconds (a rank that does not call: EPX_ERROR_TIMEOUT naming
      it); needs no MPI.
    - ``"mpi"`` (CPU groups across hosts): the MPI transport over the same
      processes, which mpirun must have started (MPI_COMM_WORLD through mpi4py
      when installed, else found through the MPI libepx links); needs a libepx
      built with MPI.
    - ``"ipc"`` (chosen for an NCCL group whose ranks share a GPU, e.g.
      ``torchrun --nproc_per_node 4`` on a one-GPU machine, which NCCL
      refuses; the ranks' GPUs are compared by UUID through the store): the
      shm comm above, whose CUDA buffers move rows between the processes'
      device memory through CUDA IPC (epx.h, epx_comm_create_shm). Every
      process of one host. For correctness and CI, not speed; the fused
      path is refused where processes share a GPU (Buffer.peer_paths says
      HOST, Buffer.creation_note why) and the host path serves.
      epx.deep_ep and the drop-ins take it with no change to the script;
      the framework's own torch collectives still need a group that can
      run them there (gloo).

    The comm's ``transport`` attribute says which was chosen.
    """
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not dist.is_available() or not dist.is_initialized():
        _invalid("%s: torch.distributed is not initialised; call "
                 "torch.distributed.init_process_group (or epx.torch.init_process_group) "
                 "first", fn)
    if group is None:
        group = dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    config = _comm_config(timeout_seconds)
    chosen = _transport_of(group, rank, size, transport, config.timeout_seconds, fn)
    if chosen == "nccl":
        comm = _nccl_comm(group, rank, size, config)
    elif chosen in ("shm", "ipc"):
        comm = _shm_comm(group, rank, size, config, chosen)
    else:
        comm = _mpi_comm(group, rank, size, config)
    if isinstance(comm, _epx.Comm):
        comm.transport = chosen
    return comm


# Each launcher's rank, size, local rank and local size, in torch's names.
_LAUNCHERS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),                      # torchrun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),                                                 # Open MPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),               # MPICH, Intel
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),    # srun
)
_JOB_IDS = ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME",
            "SLURM_JOB_ID")


def launch_env():
    """(rank, world_size, local_rank, local_world_size) from whichever
    launcher started this process (torchrun's variables first, then mpirun's
    OMPI_COMM_WORLD_*, MPICH's PMI_*, srun's SLURM_*); None if none did."""
    for names in _LAUNCHERS:
        if names[0] in os.environ and names[1] in os.environ:
            rank, size = int(os.environ[names[0]]), int(os.environ[names[1]])
            local_rank = int(os.environ.get(names[2], rank))
            local_size = os.environ.get(names[3], str(size)).split("(")[0].split(",")[0]
            return rank, size, local_rank, int(local_size)
    return None


def _job_store(job, rank, size, timeout):
    """A TCPStore for the ranks of one host: rank 0 serves it on a free port
    and writes the port to a file named after the job id, which the others
    read; rank 0 removes the file once every rank has joined."""
    import datetime
    import tempfile
    import time
    import torch.distributed as dist
    fn = "epx.torch.init_process_group"
    timeout = timeout or datetime.timedelta(minutes=5)
    path = os.path.join(tempfile.gettempdir(), "epx-torch-%s.port" % job)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
        with open(path + ".%d" % os.getpid(), "w") as f:
            f.write(str(store.port))
        os.replace(path + ".%d" % os.getpid(), path)
        try:
            while store.add("epx/joined", 0) < size - 1:
                if time.monotonic() > deadline:
                    _refuse(Status.ERROR_TIMEOUT, "%s: %d of %d ranks joined rank 0's store "
                            "within %s", fn, store.add("epx/joined", 0) + 1, size, timeout)
                time.sleep(0.01)
        finally:
            os.remove(path)
        return store
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            _refuse(Status.ERROR_TIMEOUT, "%s: rank 0 did not publish its store (%s) within "
                    "%s; is rank 0 running?", fn, path, timeout)
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout)
    store.add("epx/joined", 1)
    return store


def init_process_group(backend=None, **kwargs):
    """torch.distributed.init_process_group for a process started by
    torchrun, mpirun, mpiexec (MPICH) or srun, with no variables to map: the
    rank and size come from the launcher (:func:`launch_env`), and where
    MASTER_ADDR/MASTER_PORT are unset and every rank is on this host, rank 0
    serves a TCPStore on a free port that it tells the others through a file
    named after the launcher's job id (removed once all have joined). backend
    None: "nccl" where torch sees a GPU for each of this host's processes,
    "gloo" where they share GPUs (NCCL refuses two ranks on one GPU; epx's
    comm from the group is then the shm one, its CUDA buffers over CUDA IPC)
    or there is none. Other keyword arguments go to
    torch.distributed.init_process_group."""
    import torch.distributed as dist
    fn = "epx.torch.init_process_group"
    env = launch_env()
    if env is None:
        _invalid("%s: no launcher's variables found (RANK/WORLD_SIZE of torchrun, "
                 "OMPI_COMM_WORLD_* of mpirun, PMI_* of mpiexec, SLURM_* of srun); "
                 "launch with one of them", fn)
    rank, size, _, local_size = env
    if backend is None:
        gpus = _torch.cuda.device_count() if _torch.cuda.is_available() else 0
        backend = "nccl" if gpus and local_size <= gpus else "gloo"
    kwargs.setdefault("rank", rank)
    kwargs.setdefault("world_size", size)
    if "init_method" not in kwargs and "store" not in kwargs and not (
            "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        job = next((os.environ[v] for v in _JOB_IDS if v in os.environ), None)
        if local_size != size or job is None:
            _invalid("%s: set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port): "
                     "the ranks span hosts, or the launcher gives no job id", fn)
        kwargs["store"] = _job_store(job, rank, size, kwargs.get("timeout"))
    dist.init_process_group(backend, **kwargs)
