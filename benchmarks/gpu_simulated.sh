#!/usr/bin/env bash
# Simulated ranks of multi-GPU layouts (tools.simulate_rank) on one GPU, beside a real single run, all --profile'd:
# GPT-2 Large, seq 1024, bf16, --compile, synthetic tokens, micro-batch $BATCH.
#   OUT=/tmp/out LAYOUTS="single zero3-tp2 fsdp2-tp2" bash benchmarks/gpu_simulated.sh
# LAYOUTS (default: all below) names the runs; each simulated one is rank 0 of 4 GPUs. EXTRA: more train.py flags for
# every run (e.g. EXTRA="--zero3-unit-blocks 12"), named in the run folders by TAG (e.g. TAG=u12).
# Writes $OUT/runs/<name>/, packs every run's summary, profile breakdown and top kernels into
# $OUT/simulated-runs.tgz and prints the table (benchmarks/simulated_ranks.py). A run that fails is reported and the
# next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh
gpt2_python_env
# shellcheck source=benchmarks/run_names.sh
source benchmarks/run_names.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT=${OUT:?set OUT}
BATCH=${BATCH:-8}
STEPS=${STEPS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}  # a cold compile of a ZeRO-3 layout takes minutes
RUNS=${RUNS:-/tmp/simulated/runs}
LAYOUTS=${LAYOUTS:-single zero3-dp4 zero3-tp2 zero3-tp2-sp fsdp2-dp4 fsdp2-tp2 fsdp2-tp2-sp}
read -r -a EXTRA_FLAGS <<<"${EXTRA:-}"
TAG=${TAG:-}
mkdir -p "$OUT" "$RUNS"
COMMON=(--model gpt2-large --seq-len 1024 --precision bf16 --data synthetic --max-steps "$STEPS" --log-interval 5
        --warmup-steps 5 --throughput-warmup-steps 5 --eval-batches 2 --wandb disabled --compile --profile
        --batch-size "$BATCH" --out-dir "$RUNS" "${EXTRA_FLAGS[@]}")
SIM=("$PYTHON" -m tools.simulate_rank --world-size 4 --)

flags_of() {  # the layout's launch, before COMMON
  case $1 in
    single) echo "$PYTHON train.py --mode single" ;;
    zero3-dp4) echo "${SIM[*]} --mode hybrid" ;;
    zero3-tp2) echo "${SIM[*]} --mode hybrid --tp-size 2" ;;
    zero3-tp2-sp) echo "${SIM[*]} --mode hybrid --tp-size 2 --sequence-parallel" ;;
    fsdp2-dp4) echo "${SIM[*]} --mode hybrid --zero-engine fsdp2" ;;
    fsdp2-tp2) echo "${SIM[*]} --mode hybrid --zero-engine fsdp2 --tp-size 2" ;;
    fsdp2-tp2-sp) echo "${SIM[*]} --mode hybrid --zero-engine fsdp2 --tp-size 2 --sequence-parallel" ;;
    *) echo "unknown layout $1" >&2; return 1 ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/versions.txt"
"$PYTHON" -c "import torch, deepspeed; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__)" \
  | tee -a "$OUT/versions.txt"
done_runs=()
for layout in $LAYOUTS; do
  launch=$(flags_of "$layout") || continue
  # a rerun gets NAME-1.log and NAME-1/, never the old ones
  name=$(free_run_name "$RUNS" "$RUNS" "$layout-b$BATCH${TAG:+-$TAG}")
  echo "=== $name: $launch ${COMMON[*]}"
  # shellcheck disable=SC2086 (the launch is words)
  if timeout "$RUN_TIMEOUT" $launch "${COMMON[@]}" --run-name "$name" >"$RUNS/$name.log" 2>&1; then
    grep -h "summary:" "$RUNS/$name.log" | tail -1
    done_runs+=("$RUNS/$name")
  else
    echo "  FAILED (exit $?):"; grep -E "Error|error" "$RUNS/$name.log" | tail -3
  fi
done
if [ ${#done_runs[@]} -gt 0 ]; then
  "$PYTHON" -m benchmarks.simulated_ranks "${done_runs[@]}" --out "$OUT" \
    --command "LAYOUTS='$LAYOUTS' BATCH=$BATCH${EXTRA:+ EXTRA='$EXTRA'} bash benchmarks/gpu_simulated.sh"
fi
(cd "$RUNS" && tar czf "$OUT/simulated-runs-b$BATCH.tgz" ./*.log ./*/summary.json ./*/config.json \
  ./*/profile_breakdown.json ./*/profile_kernels.txt ./*/profile_host.txt 2>/dev/null)
ls -la "$OUT"
