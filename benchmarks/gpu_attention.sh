#!/usr/bin/env bash
# --attn auto and the attention / Liger-Kernel anchors on a GPU in one call (stage limits 90 + 50 + 45 + 75 s;
# typically under 3 minutes):
#   1. liger: make the liger-kernel wheel importable (unzipped to a temporary folder on PYTHONPATH, nothing installed;
#      skipped where liger_kernel already imports); report whether flash-attn imports
#   2. tests: the attention tests that need a GPU (auto at GPT-2 Large's shape, each forced SDPA kernel against the
#      reference and under torch.compile) and the forced-kernel compile test (Dynamo tracing sdpa_kernel)
#   3. attn: benchmarks/attention_backends.py at [8|32, 20, 1024, 64] bf16 -> attention_backends.{csv,md}
#   4. train: a tiny compiled train.py run with --attn auto (the choice in its summary)
#   5. kernels: benchmarks/kernels.py --quick on layernorm and cross_entropy (eager, torch.compile, triton, Liger)
#      -> kernels.{csv,md} with "where ours lose"
# Results in ${OUT:-benchmarks/results/attention}: attn_env.txt and one log per stage.
#
#   OUT=/tmp/a bash benchmarks/gpu_attention.sh
#   LIGER_WHL=/path/liger_kernel-0.8.5-py3-none-any.whl STAGES="liger kernels" bash benchmarks/gpu_attention.sh
set -u
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh
gpt2_python_env
OUT=${OUT:-benchmarks/results/attention}
mkdir -p "$OUT"
STAGES=${STAGES:-liger tests attn train kernels}
KERNEL_ARGS=${KERNEL_ARGS:---quick --kernels layernorm,cross_entropy --compile-budget-s 60}
LIGER_WHL=${LIGER_WHL:-$(ls .whl/liger_kernel-*.whl 2>/dev/null | tail -1)}

STAGE_TAIL=40
# shellcheck source=benchmarks/stages.sh
source benchmarks/stages.sh  # stage NAME LIMIT_S LOG CMD...

case " $STAGES " in *" liger "*)
  if ! "$PYTHON" -c 'import liger_kernel' 2>/dev/null && [ -n "$LIGER_WHL" ]; then
    LIGER_DIR=$(mktemp -d)
    "$PYTHON" -m zipfile -e "$LIGER_WHL" "$LIGER_DIR" && export PYTHONPATH="$LIGER_DIR${PYTHONPATH:+:$PYTHONPATH}"
  fi ;;
esac
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
  "$PYTHON" -c 'import liger_kernel, importlib.metadata as m; print("liger_kernel", m.version("liger_kernel"), liger_kernel.__file__)' 2>&1 | tail -1
  "$PYTHON" -c 'import flash_attn; print("flash_attn", flash_attn.__version__)' 2>&1 | tail -1
} > "$OUT/attn_env.txt" 2>&1
cat "$OUT/attn_env.txt"

stage tests 90 attn_tests.txt "$PYTHON" -m pytest -q -p no:cacheprovider -rs -s tests/unit/test_fused_attention.py \
  -k "gpu or compile"
stage attn 50 attn_bench.txt "$PYTHON" -m benchmarks.attention_backends --out "$OUT"
stage train 45 attn_train.txt "$PYTHON" train.py --model gpt2-tiny --data synthetic --max-steps 8 --batch-size 8 \
  --seq-len 256 --attn auto --compile --wandb disabled --out-dir "$OUT/runs" --run-name attn-auto
# shellcheck disable=SC2086  # KERNEL_ARGS is a list of flags
stage kernels 75 attn_kernels.txt "$PYTHON" -m benchmarks.kernels --out "$OUT" $KERNEL_ARGS
grep -h '"attn' "$OUT"/runs/*/summary.json 2>/dev/null
echo "=== done in ${SECONDS}s; results in $OUT"
