#!/usr/bin/env bash
# The loss-parity matrix on every GPU of one machine, beside the multi-GPU tests, within one time limit.
#   OUT=/tmp/out MODEL=gpt2 bash benchmarks/gpu_parity.sh [tools.parity flags...]
#   OUT=/tmp/out MODEL=gpt2-large TESTS=0 bash benchmarks/gpu_parity.sh   # at tools.parity's protocol for the model
# - installs the wheels carried in .whl/ (DeepSpeed, pytest) where they are missing (a GPU machine with no index);
# - data: .gpudata/ (wikitext-2, gpt2-tokenizer/tokenizer.json and a token cache built where `datasets` exists:
#   python -m gpt2.data --data-path .gpudata/wikitext-2 --tokenizer .gpudata/gpt2-tokenizer/tokenizer.json
#   --cache-dir .gpudata/cache);
# - runs `python -m tools.parity` for $MODEL on all visible GPUs (--jobs $JOBS rows at once on each GPU,
#   stopped at $LIMIT s: its tables keep the rows that ended) and, with TESTS=1, beside it on the last two GPUs:
#   the 2-GPU pytest tests (`-m gpu`, TP under --compile and preemption over NCCL) and the TP harness checks;
# - packs into $OUT: parity-$MODEL.tgz (parity.csv/.md/.png, every run's log, metrics.jsonl, config.json and
#   summary.json), gpu_tests.log, tp_checks.log and versions.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON (on a GPU machine without .venv: its python3), its torchrun first on PATH
gpt2_python_env
OUT=${OUT:?set OUT}
MODEL=${MODEL:-gpt2}
JOBS=${JOBS:-2}
LIMIT=${LIMIT:-540}
TESTS=${TESTS:-1}
WORK=${WORK:-/tmp/gpu_parity}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$WORK"
"$PYTHON" -c "import deepspeed, pytest, pytest_timeout" 2>/dev/null ||
  "$PYTHON" -m pip install -q --no-index --find-links .whl deepspeed pytest pytest-timeout
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  "$PYTHON" -c "import torch, deepspeed, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'deepspeed', deepspeed.__version__, 'triton', triton.__version__)"; } | tee "$OUT/versions.txt"
ngpu=$(nvidia-smi --list-gpus | wc -l)

if [ "$TESTS" = 1 ] && [ "$ngpu" -ge 2 ]; then
  last2="$((ngpu - 2)),$((ngpu - 1))"
  (
    CUDA_VISIBLE_DEVICES=$last2 timeout "$LIMIT" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_gpu_tp_compile.py tests/integration/test_preemption.py > "$OUT/gpu_tests.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
    for check in "2 groups 2" "2 layers 2" "2 model 2"; do
      read -r n name tp <<< "$check"
      CUDA_VISIBLE_DEVICES=$last2 timeout 200 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$n" \
        -m tests._tp_harness --check "$name" --tp "$tp" > "$WORK/check.log" 2>&1
      echo "check $name nproc=$n tp=$tp rc=$? $(grep -ho 'OK:.*' "$WORK/check.log" | tail -1)" >> "$OUT/tp_checks.log"
      grep -m3 -h "Error" "$WORK/check.log" >> "$OUT/tp_checks.log"
    done
  ) &
  tests_pid=$!
fi

timeout --kill-after=15 "$LIMIT" "$PYTHON" -m tools.parity --models "$MODEL" --jobs "$JOBS" --out "$WORK/$MODEL" \
  --data-path .gpudata/wikitext-2 --tokenizer .gpudata/gpt2-tokenizer/tokenizer.json --cache-dir .gpudata/cache \
  "$@" 2>&1 | tail -n 70
if [ -n "${tests_pid:-}" ]; then
  wait "$tests_pid"
  tail -n 15 "$OUT/gpu_tests.log"
  cat "$OUT/tp_checks.log"
fi
(cd "$WORK/$MODEL" && tar czf "$OUT/parity-$MODEL.tgz" parity.* ./*.png logs \
  runs/*/metrics.jsonl runs/*/config.json runs/*/summary.json 2>/dev/null)
ls -la "$OUT"
