#!/usr/bin/env bash
# The checks the CPU-only CI cannot run, on a machine with a CUDA GPU and the project installed:
#
#   bash scripts/gpu-check.sh [OUTPUT_DIR]      # default test-output/gpu-check
#
# Prints the GPU and library versions, the MFU benchmark (both models as shipped, then the
# 1B-shaped model at batch 8 eager and through torch.compile), and the gpu-marked tests.
# Each step's output is also written to OUTPUT_DIR; the exit status is the first failure's.
# PYTHON picks the interpreter (default: python).
set -uo pipefail
out=${1:-test-output/gpu-check}
py=${PYTHON:-python}
mkdir -p "$out"
status=0
step() { # name, command...: run, tee to $out/name.log, remember the first failure
    local name=$1 started=$SECONDS
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - started)) s"
    [[ $rc -eq 0 || $status -ne 0 ]] || status=$rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$py" -c 'import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "gpu", torch.cuda.get_device_name(0), torch.cuda.device_count())'
# DeepSpeed compiles its fused Adam on first use (nvcc, a minute or more): build it on the CPU
# while the GPU measures MFU, so the tests find it built. As the ranks do, first make the
# image's TORCH_CUDA_ARCH_LIST one DeepSpeed's builder reads (CUDA images list 9.0a).
"$py" -c 'from trainflow.strategies.deepspeed import prepare_compiled_ops
prepare_compiled_ops("cuda")
from deepspeed.ops.op_builder import FusedAdamBuilder
FusedAdamBuilder().load()' >"$out/fused_adam_build.log" 2>&1 &
build=$!
step mfu "$py" -m benchmarks.mfu
step mfu_1b_batch8 "$py" -m benchmarks.mfu --models llama-3.2-1b-shape --batch-size 8
step mfu_1b_batch8_compiled "$py" -m benchmarks.mfu --models llama-3.2-1b-shape --batch-size 8 \
    --compile
wait "$build"
echo "== fused Adam build: exit $? (log: $out/fused_adam_build.log)"
step gpu_tests "$py" -m pytest -m gpu -n 5 -p no:cacheprovider \
    tests/distributed/test_strategies_gpu.py tests/distributed/test_frameworks_ranks.py \
    tests/frameworks/test_unsloth_gpu.py
exit $status
