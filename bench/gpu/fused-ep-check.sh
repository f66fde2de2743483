#!/usr/bin/env bash
# The fused NVLink exchange inside the CUDA backend, on 2 GPUs: builds the
# library with -DEPX_BUILD_FUSED=ON and only what this needs (epx,
# mpi_gpu_exchange, bench_ep), runs mpi_gpu_exchange with the fused path
# required (EPX_GPU_EXPECT_FUSED=1; EPX_GPU_TEST_QUICK=1 unless
# EPX_FUSED_EP_FULL=1), then bench_ep's sections ${EPX_BENCH_EP_SECTIONS:-sweep,step}
# (the fused vs host sweep over SM budgets and the whole-step sweep). A
# shorter path than bench/gpu-check.sh for iterating on the fused path; that
# script stays the verdict. Every step has a time limit; logs go to
# ${OUT:-/tmp/epx-fused-ep}; the build to ${EPX_FUSED_EP_BUILD:-/tmp/epx-fused-ep-build}.
set -u
cd "$(dirname "$0")/../.."
OUTDIR=${OUT:-/tmp/epx-fused-ep}
BUILD=${EPX_FUSED_EP_BUILD:-/tmp/epx-fused-ep-build}
mkdir -p "$OUTDIR" "$BUILD"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# PyTorch's NCCL (nvidia.nccl is a namespace package: its __path__, not __file__)
NCCL=$(python3 -c "import nvidia.nccl;print(list(nvidia.nccl.__path__)[0])" 2>/dev/null || echo /usr/local/cuda)
export LD_LIBRARY_PATH="$NCCL/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
CMOCKA_ARGS=()
if ! echo '#include <cmocka.h>' | cc -E -x c - >/dev/null 2>&1 && [ -f .gpu-deps/include/cmocka.h ]; then
  CMOCKA_ARGS=(-DCMOCKA_INCLUDE_DIR="$PWD/.gpu-deps/include" -DCMOCKA_LIBRARY="$PWD/.gpu-deps/lib/libcmocka.so.0")
fi
MPIRUN="mpirun --allow-run-as-root --oversubscribe -np 2 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH"
step() { echo "== $1 ($(date +%T))"; }

# EPX_FUSED_EP_SYSTEM_NCCL=path/to/libnccl.so: a second build against that
# NCCL (headers from its ../../include), its test run last, briefly: to see
# whether the fused path works (or why it is refused) with another NCCL.
SYS=${EPX_FUSED_EP_SYSTEM_NCCL:-}
if [ -n "$SYS" ]; then
  ( timeout "${EPX_FUSED_EP_BUILD_TIMEOUT:-240}" cmake -S . -B "$BUILD-sys" -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_CUDA=ON \
      -DEPX_CUDA_ARCHITECTURES=90 -DEPX_BUILD_MPI=ON -DEPX_BUILD_FUSED=ON -DEPX_TEST_HOOKS=ON -DEPX_NCCL_LIBRARY="$SYS" \
      -DEPX_NCCL_INCLUDE_DIR="$(dirname "$SYS")/../../include" "${CMOCKA_ARGS[@]}" &&
    timeout "${EPX_FUSED_EP_BUILD_TIMEOUT:-240}" cmake --build "$BUILD-sys" -j"$(nproc)" --target epx mpi_gpu_exchange
  ) >"$OUTDIR/build-sys.log" 2>&1 &
  SYS_PID=$!
fi

step build
{
  timeout "${EPX_FUSED_EP_BUILD_TIMEOUT:-240}" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_CUDA=ON \
    -DEPX_CUDA_ARCHITECTURES=90 -DEPX_BUILD_MPI=ON -DEPX_NCCL_ROOT="$NCCL" -DEPX_BUILD_FUSED=ON -DEPX_TEST_HOOKS=ON \
    "${CMOCKA_ARGS[@]}" &&
    timeout "${EPX_FUSED_EP_BUILD_TIMEOUT:-240}" cmake --build "$BUILD" -j"$(nproc)" --target epx mpi_gpu_exchange
} >"$OUTDIR/build.log" 2>&1 || { tail -40 "$OUTDIR/build.log"; echo "build FAILED"; exit 1; }
grep -q "EPX_HAVE_FUSED=1" "$BUILD/CMakeFiles/epx.dir/flags.make" || { echo "the fused module was not built"; exit 1; }
mpicc -O2 -std=c11 -Iinclude -Isrc -I"$NCCL/include" -I/usr/local/cuda/include bench/gpu/bench_ep.c -o "$BUILD/bench_ep" \
  -L"$BUILD" -lepx -L/usr/local/cuda/lib64 -lcudart -lcublas -L"$NCCL/lib" -l:libnccl.so.2 -lm \
  -Wl,-rpath,"$BUILD" -Wl,-rpath,"$NCCL/lib" -Wl,-rpath,/usr/local/cuda/lib64 >>"$OUTDIR/build.log" 2>&1 || { tail -20 "$OUTDIR/build.log"; echo "bench build FAILED"; exit 1; }
echo "built in ${SECONDS}s"

step "mpi_gpu_exchange (fused path required)"
QUICK=1
[ "${EPX_FUSED_EP_FULL:-0}" = 1 ] && QUICK=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
EPX_GPU_EXPECT_FUSED=1 EPX_GPU_TEST_QUICK=$QUICK timeout "${EPX_FUSED_EP_TEST_TIMEOUT:-120}" \
  $MPIRUN -x EPX_GPU_EXPECT_FUSED -x EPX_GPU_TEST_QUICK -x NCCL_DEBUG "$BUILD/tests/gpu/mpi_gpu_exchange" \
  >"$OUTDIR/test.log" 2>&1
rc=$?
grep -v "^ *$" "$OUTDIR/test.log" | head -12
tail -3 "$OUTDIR/test.log"
[ $rc = 0 ] || echo "mpi_gpu_exchange FAILED (exit $rc)"
TEST_RC=$rc

step "bench_ep sections ${EPX_BENCH_EP_SECTIONS:-sweep,step}"
EPX_BENCH_EP_SECTIONS=${EPX_BENCH_EP_SECTIONS:-sweep,step} timeout "${EPX_FUSED_EP_BENCH_TIMEOUT:-200}" \
  $MPIRUN -x EPX_BENCH_EP_SECTIONS "$BUILD/bench_ep" "$OUTDIR" >"$OUTDIR/bench.log" 2>&1
rc=$?
grep -E "^(DEVICE|RESULT|TARGET|STEP|CHECK)|FAILED|bench_ep:|rank [0-9]:" "$OUTDIR/bench.log" | sed 's/ (slowest [0-9.]*)//'
[ $rc = 0 ] || echo "bench_ep FAILED (exit $rc)"
BENCH_RC=$rc

if [ -n "$SYS" ]; then
  step "mpi_gpu_exchange against $SYS"
  wait "$SYS_PID" || { tail -5 "$OUTDIR/build-sys.log"; echo "system-NCCL build FAILED"; }
  grep "NCCL transport with" "$OUTDIR/build-sys.log"
  LD_LIBRARY_PATH=$(dirname "$SYS") EPX_GPU_EXPECT_FUSED=1 EPX_GPU_TEST_QUICK=1 timeout "${EPX_FUSED_EP_SYS_TIMEOUT:-30}" \
    $MPIRUN -x EPX_GPU_EXPECT_FUSED -x EPX_GPU_TEST_QUICK -x NCCL_DEBUG "$BUILD-sys/tests/gpu/mpi_gpu_exchange" \
    >"$OUTDIR/test-sys.log" 2>&1
  echo "exit $?"
  grep -v "^ *$" "$OUTDIR/test-sys.log" | head -6
fi
if [ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]; then echo "fused-ep-check: OK (${SECONDS}s)"; else echo "fused-ep-check: FAILED"; exit 1; fi
