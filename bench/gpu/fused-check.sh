#!/usr/bin/env bash
# The fused NVLink exchange on its own (src/cuda/fused_*.cu), before it is
# plugged into the CUDA backend: builds bench/gpu/fused_standalone.cu with
# nvcc against NCCL (>= 2.28, found as shared/examples/nccl_lsa_push.sh finds
# it) and MPI, and runs it under mpirun with one rank per GPU. The program
# checks every op against its host reference, times it beside NCCL's
# send/recv of the same rows, and prints a verdict table; its last line is OK
# or FAILED. Logs go to ${OUT:-/tmp/epx-fused}. Run from anywhere in the
# repository; `fused-check.sh quick` runs only the small shapes.
# EPX_FUSED_PREBUILT=path uses a binary built on another machine when its
# libraries resolve (the script's own build takes about a minute).
set -u
cd "$(dirname "$0")/../.."
OUTDIR=${OUT:-/tmp/epx-fused}
BIN=${EPX_FUSED_BIN:-/tmp/epx-fused-bin}
mkdir -p "$OUTDIR" "$BIN"
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# PyTorch's NCCL (nvidia.nccl is a namespace package: its __path__, not __file__)
NCCL=$(python3 -c "import nvidia.nccl;print(list(nvidia.nccl.__path__)[0])" 2>/dev/null || echo /usr/local/cuda)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  nvcc --version | tail -2
  echo "NCCL from $NCCL; GPUs: $NGPU"
} >"$OUTDIR/fused-build.log" 2>&1
MPI_COMPILE=$(mpicc --showme:compile)
MPI_LINK=$(mpicc --showme:link | sed 's/-Wl,/-Xlinker /g; s/,/ -Xlinker /g')
set -o pipefail
export LD_LIBRARY_PATH="$NCCL/lib:$NCCL/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# A binary built elsewhere (EPX_FUSED_PREBUILT) is used when every library
# it needs resolves here; otherwise the three units compile in parallel.
NVCC_FLAGS=(-O3 -arch=sm_90 -std=c++17 -lineinfo -Iinclude -Isrc -I"$NCCL/include" -Xcompiler -fopenmp,-ffp-contract=off)
build() {
  cc -O2 -std=c11 -Iinclude -Isrc -c src/core/status.c -o "$BIN/status.o" || return 1
  local pids=() unit
  for unit in src/cuda/fused_dispatch.cu src/cuda/fused_combine.cu bench/gpu/fused_standalone.cu; do
    nvcc "${NVCC_FLAGS[@]}" $MPI_COMPILE -c "$unit" -o "$BIN/$(basename "$unit" .cu).o" &
    pids+=($!)
  done
  for unit in "${pids[@]}"; do wait "$unit" || return 1; done
  nvcc -arch=sm_90 "$BIN/fused_dispatch.o" "$BIN/fused_combine.o" "$BIN/fused_standalone.o" "$BIN/status.o" \
    -o "$BIN/fused_standalone" -L"$NCCL/lib" -L"$NCCL/lib64" -lnccl -Xlinker -rpath -Xlinker "$NCCL/lib" \
    $MPI_LINK -lgomp
}
if [ -n "${EPX_FUSED_PREBUILT:-}" ] && [ -x "$EPX_FUSED_PREBUILT" ] && ! ldd "$EPX_FUSED_PREBUILT" | grep -q "not found"; then
  cp "$EPX_FUSED_PREBUILT" "$BIN/fused_standalone"
  echo "using the prebuilt $EPX_FUSED_PREBUILT" | tee -a "$OUTDIR/fused-build.log"
elif ! build >>"$OUTDIR/fused-build.log" 2>&1; then
  tail -30 "$OUTDIR/fused-build.log"
  echo "build FAILED"
  echo FAILED
  exit 1
fi
echo "built in ${SECONDS}s"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
timeout "${EPX_FUSED_TIMEOUT:-480}" mpirun --allow-run-as-root --oversubscribe -np "${EPX_FUSED_RANKS:-$NGPU}" \
  -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH \
  -x OMP_NUM_THREADS "$BIN/fused_standalone" "$@" 2>&1 | tee "$OUTDIR/fused.log"
rc=$?
[ $rc = 0 ] || { echo "fused_standalone exit code $rc"; echo FAILED; }
exit $rc
