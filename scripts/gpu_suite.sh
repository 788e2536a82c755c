#!/usr/bin/env bash
# Run on the GPU machine (carry what scripts/make_gpu_payload.sh prints: .devpayload and build/*).
# Every check tvmkv has for CUDA, each step logged to $OUT (or /tmp/tvmkv_gpu): the gpu-marked kernel and
# cache tests, replays of every scenario, a short soak, and the tiny Llama through both Relax routes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tvmkv_gpu}
mkdir -p "$out"
source .devpayload/setup.sh
export TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 TVMKV_CUDA_ARCH=${TVMKV_CUDA_ARCH:-sm_90}
export PYTHONPATH=$PWD:$PWD/.devpayload${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/card.txt"
status=0
step() {  # step NAME CMD...: run, log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  if "$@" > "$out/$name.log" 2>&1; then echo "-- $name OK ($((SECONDS - t0))s)"; else
    echo "-- $name FAILED ($((SECONDS - t0))s)"; status=1; fi
  tail -n "${TAIL:-4}" "$out/$name.log"
}
parts=${PARTS:-tests,bench}  # PARTS=tests or PARTS=bench runs one half (each fits one 10-minute device call)
if [[ $parts == *tests* ]]; then
step kernels python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_kernels.py tests/test_ops_kernels.py
step cache python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cache.py
step issue8 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_interop.py tests/test_prefix.py \
    tests/test_swap_sched.py
for rope in normal inline none; do
  step "replay_$rope" python3 -m tvmkv replay --target cuda --rope-mode "$rope"
done
step replay_fp16 python3 -m tvmkv replay --target cuda --dtype float16 --rope-mode normal
step replay_split python3 -m tvmkv replay --target cuda --rope-mode inline --decode-splits 4
soak='import sys, runpy, tvm_cuda_runtime; sys.argv[0] = "bench/soak.py"; runpy.run_path(sys.argv[0], run_name="__main__")'
step soak python3 -c "$soak" --target cuda --ops "${SOAK_OPS:-3000}" --json "$out/soak.json"
runner='import sys, tvm_cuda_runtime; from tvmkv.generate import main; sys.exit(main(sys.argv[1:]))'
step generate python3 -c "$runner" --target cuda --model-lib build/cuda-sm_90/models/tiny_llama.so
step generate_tvm python3 -c "$runner" --target cuda --interface tvm --model-lib build/cuda-sm_90/models/tiny_llama_tvm.so
step generate_fp16 python3 -c "$runner" --target cuda --dtype float16 --model-lib build/cuda-sm_90/models/tiny_llama_fp16.so
step generate_swap python3 -c "$runner" --target cuda --model-lib build/cuda-sm_90/models/tiny_llama.so \
    --num-pages 6 --preemption swap
step generate_recompute python3 -c "$runner" --target cuda --model-lib build/cuda-sm_90/models/tiny_llama.so \
    --num-pages 6 --preemption recompute
step host_path python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_host_path.py
fi
if [[ $parts == *bench* ]] && [ -z "${NO_BENCH:-}" ]; then  # issue 4/5/8 measurements (need build/tvm-cuda-sm_90, build/host-stubs-cuda)
  # TVM's cache and kernels run in worker processes (a crash is reported per case, not fatal)
  TAIL=40 step bench_gpu python3 bench/gpu.py --tvm-lib build/tvm-cuda-sm_90 --out "$out"
  TAIL=16 step bench_split python3 bench/gpu.py --split-sweep --out "$out"
  TAIL=20 step bench_host python3 bench/host.py --target cuda --stubs build/host-stubs-cuda --out "$out"
  TAIL=20 step bench_swap python3 bench/swap.py --target cuda --out "$out"
  TAIL=20 step bench_prefix python3 bench/prefix.py --target cuda
fi
exit $status
