#!/usr/bin/env bash
# Host-side A/B of bench/gpu/bench_ep.c on one GPU (the W-rank backend at one
# rank, as gpu-check runs it): an older source tree (A) against this one (B),
# both built and run on the same machine in the same session, the runs
# interleaved A B A B ..., so that a difference in host time per call is the
# code's and not the machine's (two device sessions differ by several us per
# call on unchanged code). Run from the repository root, on the GPU machine:
#
#   git archive 2defd34 | (mkdir -p ab-old && tar -x -C ab-old)   # here, before
#   bench/gpu/ab_host.sh build ab-old       # both libraries and benches (minutes)
#   bench/gpu/ab_host.sh run ab-old 3       # 3 rounds of A then B
#
# Prints, per RESULT row and host-bound figure (host_us_per_call, layout_us,
# weights_backward_us), the median of the rounds for A and B and B - A.
# Outputs under $OUT (or /tmp/epx-ab): a_N.log, b_N.log, ab.txt.
set -u
cd "$(dirname "$0")/../.." || exit 1
MODE=${1:?usage: ab_host.sh build|run OLD_TREE [ROUNDS]}
OLD=${2:?usage: ab_host.sh build|run OLD_TREE [ROUNDS]}
ROUNDS=${3:-3}
OUTDIR=${OUT:-/tmp/epx-ab}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0
NCCL=$(python3 -c "import nvidia.nccl;print(list(nvidia.nccl.__path__)[0])" 2>/dev/null || echo /usr/local/cuda)
JOBS=$(nproc 2>/dev/null || echo 8)

# build_tree SRC: the library (gpu-check's configuration) in SRC/build-ab and
# SRC's bench_ep against it, as gpu-check's build_bench_ep builds it.
build_tree() {
  local src=$1 b=$1/build-ab
  cmake -S "$src" -B "$b" -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_CUDA=ON -DEPX_CUDA_ARCHITECTURES=90 \
    -DEPX_BUILD_MPI=ON -DEPX_NCCL_ROOT="$NCCL" -DEPX_BUILD_FUSED=ON -DEPX_TEST_HOOKS=ON \
    -DEPX_BUILD_TESTS=OFF >"$OUTDIR/build_$(basename "$src").log" 2>&1 &&
    cmake --build "$b" -j"$JOBS" --target epx >>"$OUTDIR/build_$(basename "$src").log" 2>&1 &&
    (cd "$src" && mpicc -O2 -std=c11 -Iinclude -Isrc -I"$NCCL/include" -I/usr/local/cuda/include \
      bench/gpu/bench_ep.c -o build-ab/bench_ep -Lbuild-ab -lepx -L/usr/local/cuda/lib64 -lcudart -lcublas \
      -L"$NCCL/lib" -l:libnccl.so.2 -lm -Wl,-rpath,"$PWD/build-ab" -Wl,-rpath,"$NCCL/lib" \
      -Wl,-rpath,/usr/local/cuda/lib64) >>"$OUTDIR/build_$(basename "$src").log" 2>&1
}

run_tree() { # run_tree SRC LOG
  EPX_BENCH_EP_SECTIONS=layout,main LD_LIBRARY_PATH="$NCCL/lib:${LD_LIBRARY_PATH:-}" timeout 280 \
    mpirun --allow-run-as-root -np 1 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x EPX_BENCH_EP_SECTIONS \
    "$1/build-ab/bench_ep" "$OUTDIR" >"$2" 2>&1
}

case $MODE in
  build)
    build_tree "$OLD" || { echo "A ($OLD): build failed, see $OUTDIR"; exit 1; }
    build_tree . || { echo "B (this tree): build failed, see $OUTDIR"; exit 1; }
    echo "built A ($OLD) and B (this tree)" ;;
  run)
    for i in $(seq 1 "$ROUNDS"); do
      run_tree "$OLD" "$OUTDIR/a_$i.log" || echo "A round $i failed (exit $?)"
      run_tree . "$OUTDIR/b_$i.log" || echo "B round $i failed (exit $?)"
    done
    python3 - "$OUTDIR" "$ROUNDS" <<'EOF' | tee "$OUTDIR/ab.txt"
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ("host_us_per_call", "layout_us", "weights_backward_us")
def figures(path):
    rows = {}
    for line in open(path, errors="replace"):
        if not line.startswith("RESULT "): continue
        name = re.split(r" (?:dispatch_ms|us)=", line[7:], 1)[0]
        for k in keys:
            m = re.search(r"\b%s=([0-9.]+)" % k, line)
            if m: rows[(name, k)] = float(m.group(1))
    return rows
runs = {s: [figures("%s/%s_%d.log" % (out, s, i)) for i in range(1, rounds + 1)] for s in "ab"}
print("A = the older tree, B = this tree; medians of %d interleaved rounds (us)" % rounds)
diffs = []
for key in runs["a"][0]:
    a = [r[key] for r in runs["a"] if key in r]; b = [r[key] for r in runs["b"] if key in r]
    if not a or not b: continue
    ma, mb = statistics.median(a), statistics.median(b)
    diffs.append(mb - ma)
    print("%-24s A %7.1f  B %7.1f  B-A %+6.1f  %s" % (key[1], ma, mb, mb - ma, key[0]))
if diffs: print("B-A over %d figures: median %+.1f us, mean %+.1f us" % (len(diffs), statistics.median(diffs), statistics.mean(diffs)))
EOF
    ;;
  *) echo "mode: build or run"; exit 2 ;;
esac
