#!/usr/bin/env bash
# Run on the GPU machine (carry what scripts/make_gpu_payload.sh prints: .devpayload and build/*).
# Every check tvmkv has for CUDA, each step logged to $OUT (or /tmp/tvmkv_gpu): the prebuilt libraries
# load, the gpu-marked kernel and cache tests, replays of every scenario, a short soak, the tiny Llama
# through both Relax routes; then the benchmarks.
#   PARTS=tests | PARTS=bench   one half (each fits one 10-minute device call); default both
#   TVMKV_CUDA_ARCH=sm_90       the arch the payload was built for (build/cuda-<arch>)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tvmkv_gpu}
mkdir -p "$out"
source .devpayload/setup.sh
arch=${TVMKV_CUDA_ARCH:-sm_90}
export TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 TVMKV_CUDA_ARCH=$arch
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
pytest_gpu=(python3 -m pytest -q -m gpu -p no:cacheprovider)
models=build/cuda-$arch/models
parts=${PARTS:-tests,bench}
if [[ $parts == *tests* ]]; then
step prebuilt python3 scripts/check_prebuilt_kernels.py "build/cuda-$arch"
step kernels "${pytest_gpu[@]}" tests/test_attention_kernels.py tests/test_ops_kernels.py
step cache "${pytest_gpu[@]}" tests/test_cache.py
step interop_prefix_swap "${pytest_gpu[@]}" tests/test_interop.py tests/test_prefix.py tests/test_swap_sched.py
for rope in normal inline none; do
  step "replay_$rope" python3 -m tvmkv replay --target cuda --rope-mode "$rope"
done
step replay_fp16 python3 -m tvmkv replay --target cuda --dtype float16 --rope-mode normal
step replay_split python3 -m tvmkv replay --target cuda --rope-mode inline --decode-splits 4
step soak python3 bench/soak.py --target cuda --ops "${SOAK_OPS:-3000}" --json "$out/soak.json"
step generate python3 -m tvmkv generate --target cuda --model-lib "$models/tiny_llama.so"
step generate_tvm python3 -m tvmkv generate --target cuda --interface tvm --model-lib "$models/tiny_llama_tvm.so"
step generate_fp16 python3 -m tvmkv generate --target cuda --dtype float16 --model-lib "$models/tiny_llama_fp16.so"
step generate_swap python3 -m tvmkv generate --target cuda --model-lib "$models/tiny_llama.so" \
    --num-pages 6 --preemption swap
step generate_recompute python3 -m tvmkv generate --target cuda --model-lib "$models/tiny_llama.so" \
    --num-pages 6 --preemption recompute
step host_path "${pytest_gpu[@]}" tests/test_host_path.py
fi
if [[ $parts == *bench* ]] && [ -z "${NO_BENCH:-}" ]; then  # needs build/tvm-cuda-<arch>, build/host-stubs-cuda
  # TVM's cache and kernels run in worker processes (a crash is reported per case, not fatal)
  TAIL=40 step bench_attention python3 bench/gpu_attention.py --tvm-lib "build/tvm-cuda-$arch" --out "$out"
  TAIL=16 step bench_decode_split python3 bench/gpu_decode_split.py --out "$out"
  TAIL=20 step bench_host python3 bench/host.py --target cuda --stubs build/host-stubs-cuda --out "$out"
  TAIL=20 step bench_swap python3 bench/swap.py --target cuda --out "$out"
  TAIL=20 step bench_prefix python3 bench/prefix.py --target cuda
fi
exit $status
