#!/usr/bin/env bash
# epx.deep_ep on the GPU (issue 35), invoked by bench/gpu-check.sh or alone
# from the repository root: DeepEP's API on CUDA tensors against the plain
# PyTorch reference (tests/python/test_deep_ep.py, one process), NeMo
# Automodel's fused_a2a with its recompute replay (one process), the calls'
# overhead against epx.torch's, and NeMo's recompute with and without layout
# replay at T=4096, H=4096, 64 experts, top-6; with 2 GPUs also the 2-process
# tests, DeepSpeed AutoEP's deepep path (its _deepep_route runs its
# CUDA-only barrier here) and NeMo's own MoE layer (its fused permute where
# Transformer Engine is installed). Needs libepx built with CUDA
# (EPX_LIBRARY), torch with CUDA, and the wheels carried: deepspeed==0.19.8,
# megatron-core==0.16.1, nemo-automodel==0.7.0 (--no-deps),
# transformers==5.18.0. With 1 GPU, the 2-process tests run there too
# (issue 39): both processes on the one GPU, a gloo group (NCCL refuses two
# ranks on one GPU), epx's comm the shm one whose CUDA buffers move rows
# through CUDA IPC (epx.torch.comm_from_process_group); Megatron's flex
# dispatcher's deepep backend too. Prints one verdict line per part.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/epx-gpu}
mkdir -p "$OUT"
export EPX_DEEP_EP_DEVICE=cuda PYTHONPATH="python:tests/python:${PYTHONPATH:-}"
: "${EPX_LIBRARY:?set EPX_LIBRARY to a libepx built with CUDA}"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
run() {  # run NAME LOG COMMAND...
  local name=$1 log=$2; shift 2
  if timeout 600 "$@" >"$OUT/$log" 2>&1; then echo "$name PASS"; else echo "$name FAIL ($log)"; fi
}
TR=(python3 -m torch.distributed.run --standalone)
run "epx.deep_ep vs DeepEP semantics, 1 GPU" deep_ep_1.log "${TR[@]}" --nproc-per-node 1 tests/python/test_deep_ep.py all
run "NeMo fused_a2a + recompute replay, 1 GPU" deep_ep_nemo_1.log "${TR[@]}" --nproc-per-node 1 tests/python/test_deep_ep_frameworks.py nemo
run "epx.deep_ep overhead vs epx.torch, 1 GPU" deep_ep_overhead.log env DEVICE=cuda N=500 python3 bench/deep_ep_overhead.py
run "NeMo recompute with/without layout replay, 1 GPU" deep_ep_nemo_bench.log "${TR[@]}" --nproc-per-node 1 bench/gpu/bench_deep_ep.py
if [ "$NGPU" -ge 2 ]; then
  run "epx.deep_ep vs DeepEP semantics, 2 GPUs" deep_ep_2.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep.py all
  run "NeMo fused_a2a + recompute replay, 2 GPUs" deep_ep_nemo_2.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py nemo
  run "DeepSpeed AutoEP deepep vs comm, 2 GPUs" deep_ep_deepspeed_2.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py deepspeed
  run "NeMo MoE layer deepep vs torch dispatcher, 2 GPUs" deep_ep_nemo_layer_2.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py nemo_layer
  run "NeMo recompute with/without layout replay, 2 GPUs" deep_ep_nemo_bench2.log "${TR[@]}" --nproc-per-node 2 bench/gpu/bench_deep_ep.py
fi
if [ "$NGPU" -eq 1 ]; then
  IPC="2 processes on 1 GPU (ipc)"
  run "epx.deep_ep vs DeepEP semantics, $IPC" deep_ep_2_ipc.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep.py all
  run "epx.deep_ep vs DeepEP semantics, 4 processes on 1 GPU (ipc)" deep_ep_4_ipc.log "${TR[@]}" --nproc-per-node 4 tests/python/test_deep_ep.py all
  run "NeMo fused_a2a + recompute replay, $IPC" deep_ep_nemo_2_ipc.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py nemo
  run "DeepSpeed AutoEP deepep vs comm, $IPC" deep_ep_deepspeed_2_ipc.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py deepspeed
  run "NeMo MoE layer deepep vs torch dispatcher, $IPC" deep_ep_nemo_layer_2_ipc.log "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py nemo_layer
  # Megatron's dispatch_preprocess is a torch.compile'd jit_fuser: PyTorch
  # 2.11's dynamo fails in its own Triton device check there (a TypeError in
  # device_interface.get_device_properties, before any epx call); eager runs
  # the same code
  run "Megatron flex/deepep vs alltoall, $IPC" deep_ep_megatron_2_ipc.log env TORCHDYNAMO_DISABLE=1 "${TR[@]}" --nproc-per-node 2 tests/python/test_deep_ep_frameworks.py megatron
fi
cat "$OUT/deep_ep_overhead.log" "$OUT/deep_ep_nemo_bench.log" 2>/dev/null | grep '^|\|^T=\|^NeMo' || true
