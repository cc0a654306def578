#!/usr/bin/env bash
# Set up (scripts/setup.sh: the project's .venv unless an environment is active), then train gpt2-tiny
# for 60 steps on one device (CPU works; no hub needed): about a minute on 2 CPU cores.
# gpt2-tiny's cost is its 50,257-token LM head (97% of its FLOPs), so the demo keeps the tokens per step small
# (8 x 64) and evaluates on 8 batches, not the whole validation split.
# Data: WikiText-2 from ../shared/data when it is there (or DATA_DIR=<folder with train/valid .txt>
# and TOKENIZER=<tokenizer.json>), else synthetic tokens. Extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
gpt2_python_env
SHARED=${SHARED_DATA:-../shared/data}
DATA_DIR=${DATA_DIR:-$SHARED/wikitext-2}
TOKENIZER=${TOKENIZER:-$SHARED/gpt2-tokenizer/tokenizer.json}
if [ -d "$DATA_DIR" ] && [ -f "$TOKENIZER" ]; then
  data=(--data-path "$DATA_DIR" --tokenizer "$TOKENIZER" --num-proc 2)
else
  echo "demo: $DATA_DIR or $TOKENIZER not found: training on synthetic tokens" >&2
  data=(--data synthetic)
fi
export TOKENIZERS_PARALLELISM=false
"$PYTHON" train.py --mode single --model gpt2-tiny --seq-len 64 --batch-size 8 --max-steps 60 \
  --lr 3e-3 --warmup-steps 6 --eval-interval 30 --eval-batches 8 --log-interval 10 "${data[@]}" "$@"
