#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU machine (issue 18): the tiny Llama sharded over 2 and 4 GPUs through
# Disco with TVM's own NCCL backend, every step checked against the single-GPU model and PyTorch.
# Prepare here (a machine with the full TVM and nvcc):
#   python -m tvmkv build --target cuda --arch sm_90 --config scripts/gpu_configs.json --build-dir build/tp
#   python -m tvmkv generate --target cuda --cuda-arch sm_90 --export-lib build/tp/models/tiny.so --tensor-parallel 2
#   (again with --tensor-parallel 4; and --dtype float16 --export-lib build/tp/models/tiny16.so; and the model
#   compiled against TVM's PagedKVCache: --interface tvm --export-lib build/tp/models/tinytvm.so, tinytvm16.so)
#   python -m tvmkv.disco.nccl build/tp NCCL_ROOT    (NCCL_ROOT: nvidia-nccl-cu13 2.28.9's nvidia/nccl)
# Run there (carry .devpayload and build/tp): scripts/gpu_tensor_parallel.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp}}
source .devpayload/setup.sh >/dev/null 2>&1
export TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 TVMKV_CUDA_ARCH=sm_90 TVMKV_BUILD_DIR=$PWD/build/tp
export PYTHONPATH=$PWD:$PWD/.devpayload:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0
plugin=$PWD/build/tp/libtvm_disco_nccl.so
nvidia-smi -L
ngpu=$(nvidia-smi -L | wc -l)
status=0
run() {  # name, args...
  local name=$1; shift
  echo "== $name: generate $*"
  python3 -m tvmkv generate --target cuda --nccl-plugin "$plugin" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$out/$name.log"
  echo "== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
run tp2_fp32 --model-lib build/tp/models/tiny.so --tensor-parallel 2
run tp2_fp16 --dtype float16 --model-lib build/tp/models/tiny16.so --tensor-parallel 2
run tp2_swap --model-lib build/tp/models/tiny.so --tensor-parallel 2 --num-pages 6
if [ "$ngpu" -ge 4 ]; then
  run tp4_fp32 --model-lib build/tp/models/tiny.so --tensor-parallel 4
  run tp4_swap --model-lib build/tp/models/tiny.so --tensor-parallel 4 --num-pages 6 --preemption recompute
fi
# TVM's interface: the drop-in on every worker, vm.builtin.kv_state_* through Disco
run tp2_tvm_fp32 --interface tvm --model-lib build/tp/models/tinytvm.so --tensor-parallel 2 --num-pages 6
run tp2_tvm_fp16 --interface tvm --dtype float16 --model-lib build/tp/models/tinytvm16.so --tensor-parallel 2
if [ "$ngpu" -ge 4 ]; then
  run tp4_tvm_fp32 --interface tvm --model-lib build/tp/models/tinytvm.so --tensor-parallel 4 --num-pages 6 \
    --preemption recompute
fi
exit $status
