#!/usr/bin/env bash
# Hugging Face checkpoints on a GPU (issue 19): the small random checkpoints of tests/test_hf.py served on CUDA
# (logits saved, checked against transformers back on the build machine), then bench/hf_model.py (a
# Llama-3-8B-shaped model on TVM's cache and on tvmkv's, the same compiled model).
# Prepare here (a machine with the full TVM and nvcc; BUILD=build/hf):
#   kernel sets into $BUILD: q4/kv2/d64 p16 fp32+fp16 RoPE normal (and --local), q32/kv8/d128 p16 fp16 RoPE normal
#   checkpoints: $BUILD/hfck/{llama,qwen2,qwen3,mistral} (tests/test_hf.py's make_checkpoint; mistral window 8)
#   python -m tvmkv generate --model $BUILD/hfck/K --prompt x --target cuda --cuda-arch sm_90 --dtype D \
#       --export-lib $BUILD/hfck/K.D.so                           (each K, D in float32 float16)
#   python bench/hf_model.py --prepare $BUILD/hf8b
# Run there (carry .devpayload and $BUILD): scripts/gpu_hf.sh [OUT_DIR]; then here:
#   python scripts/check_hf_logits.py $BUILD/hfck/K OUT_DIR/K.D.npz   (each K: the logits against transformers)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp}}
build=${BUILD:-build/hf}
source .devpayload/setup.sh >/dev/null 2>&1
export TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 TVMKV_CUDA_ARCH=sm_90 TVMKV_BUILD_DIR=$PWD/$build
export PYTHONPATH=$PWD:$PWD/.devpayload:${PYTHONPATH:-}
nvidia-smi -L
status=0
prompt="the cat sat on the mat and the dog ran to the park"
for k in llama qwen2 qwen3 mistral; do
  for d in float32 float16; do
    echo "== $k $d"
    python3 -m tvmkv generate --model "$build/hfck/$k" --model-lib "$build/hfck/$k.$d.so" --target cuda --dtype $d \
      --prompt "$prompt" --max-new-tokens 12 --prefill-chunk-size 8 --ignore-eos --save-logits "$out/$k.$d.npz" \
      > "$out/$k.$d.log" 2>&1 || status=1
    tail -n 3 "$out/$k.$d.log"
  done
done
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== bench/hf_model.py"
  python3 bench/hf_model.py --from "$build/hf8b" --out "$out" ${BENCH_ARGS:-} || status=1
fi
exit $status
