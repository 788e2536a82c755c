#!/usr/bin/env bash
# Build everything the GPU machine needs to run tvmkv's GPU tests and benchmarks, on this machine:
#   .devpayload/   runtime-only TVM (via the device kit's make-payload.sh) + pytest/ml_dtypes wheels
#   build/cuda-<arch>/   prebuilt kernel sets (fatbins, no compiler needed there) + manifest.json,
#                        and models/ (the tiny Llama compiled for cuda)
#   build/tvm-cuda-<arch>/, build/host-stubs-cuda/   the TVM baselines of the benchmarks
# Usage: scripts/make_gpu_payload.sh [--arch sm_90] [--config scripts/gpu_configs.json] [-j N] [--no-wheels]
# make-payload.sh: $MAKE_PAYLOAD, else shared/device/make-payload.sh in or beside this checkout.
# Prints the `carry` list and the command to run on the GPU machine. Total must stay < 64 MiB.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
make_payload=${MAKE_PAYLOAD:-}
for cand in "$root/shared/device/make-payload.sh" "$root/../shared/device/make-payload.sh"; do
  [ -z "$make_payload" ] && [ -f "$cand" ] && make_payload=$cand
done
arch=sm_90 config=$root/scripts/gpu_configs.json jobs=2 wheels=1
while [ $# -gt 0 ]; do
  case $1 in
    --arch) arch=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    -j|--jobs) jobs=$2; shift 2 ;;
    --no-wheels) wheels=0; shift ;;
    *) echo "make_gpu_payload.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ -n "$make_payload" ] || { echo "make-payload.sh not found; set MAKE_PAYLOAD=/path/to/make-payload.sh" >&2; exit 2; }
out=$root/.devpayload
echo "== runtime-only TVM -> $out (from $make_payload)"
bash "$make_payload" "$out" "$py" >/dev/null
if [ "$wheels" = 1 ]; then
  # Pure-python pytest and its deps, plus ml_dtypes (bfloat16 <-> numpy), for cp312 on x86_64 Linux.
  # setup.sh installs every $out/*.whl with --no-deps into /tmp/site.
  echo "== wheels: pytest, iniconfig, packaging, pluggy, pygments, ml_dtypes"
  "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$out" pytest ml_dtypes 2> >(grep -v "is ignored: it is neither" >&2) \
    || echo "warning: wheel download failed; the GPU machine must bring its own pytest" >&2
  rm -f "$out"/numpy-*.whl   # the GPU machine has numpy 2.5; do not shadow it
fi
echo "== kernel sets for cuda $arch from $config"
"$py" -m tvmkv build --target cuda --arch "$arch" --config "$config" -j "$jobs" --build-dir "$root/build"
echo "== tiny Llama model libraries (tvmkv generate --model-lib) -> build/cuda-$arch/models"
models=$root/build/cuda-$arch/models
mkdir -p "$models"
for spec in "tiny_llama:--dtype float32" "tiny_llama_tvm:--dtype float32 --interface tvm" \
            "tiny_llama_fp16:--dtype float16"; do
  name=${spec%%:*}
  [ -f "$models/$name.so" ] || (cd "$root" && "$py" -m tvmkv generate --target cuda --cuda-arch "$arch" \
      ${spec#*:} --export-lib "$models/$name.so" | tail -n 1)
done
echo "== baselines for bench/gpu_attention.py and bench/host.py"
[ -f "$root/build/tvm-cuda-$arch/tvm_kv_cache.so" ] || (cd "$root" && "$py" bench/gpu_tvm_baseline.py \
    --prepare "build/tvm-cuda-$arch" --arch "$arch")
[ -d "$root/build/host-stubs-cuda" ] || (cd "$root" && "$py" bench/host.py --prepare build/host-stubs-cuda --target cuda)
echo "== sizes"
carried=("$out" "$root/build/cuda-$arch" "$root/build/tvm-cuda-$arch" "$root/build/host-stubs-cuda")
du -sh "${carried[@]}"
total_kib=$(du -sk "${carried[@]}" | awk '{s += $1} END {print s}')
echo "total carried: $((total_kib / 1024)) MiB (limit 64 MiB)"
if [ "$total_kib" -gt $((64 * 1024)) ]; then
  echo "error: .devpayload + build/cuda-$arch exceed 64 MiB; trim $config or use --no-wheels" >&2
  exit 1
fi
cat <<MSG
carry: [".devpayload", "build/cuda-$arch", "build/tvm-cuda-$arch", "build/host-stubs-cuda"]
GPU command (one call; logs and benchmark results land in \$OUT):
  TVMKV_CUDA_ARCH=$arch bash scripts/gpu_suite.sh
MSG
