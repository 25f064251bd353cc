#!/usr/bin/env bash
# Round 1 of the shipped drafters (kept for the record; round 2 is scripts/train_release.sh), trained on CPU with the project's
# trainer on data/regenerated/: DFly and DFlash (block 8) on identical code + math data, steps and batch (the same
# cached fp16 target features feed both), MTP (4 steps) on chat. The three runs go side by side, one thread each;
# rerunning the script continues each run from its last checkpoint. Then each run is written as fp16 to drafters/.
# Usage: [DEVICE=auto|cpu|cuda] scripts/train_release_round1.sh [CODE_MATH_STEPS] [CHAT_STEPS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-800}
CHAT_STEPS=${2:-200}
OUT=${3:-outputs/release}
mkdir -p "$OUT"
COMMON=(--per_device_train_batch_size 4 --learning_rate 1e-3 --warmup_steps 50 --lr_scheduler_type cosine
        --max_seq_length 384 --num_anchors 16 --logging_steps 20 --save_steps 200 --save_total_limit 1
        --report_to tensorboard --device "${DEVICE:-auto}" --eval_prompts 8 --eval_max_new_tokens 64
        --dataloader_num_workers 0 --feature_mode cached --resume true --seed 0)
train() { OMP_NUM_THREADS=1 .venv/bin/python -c "import sys, torch; torch.set_num_threads(1)
from angelspec_hf.trainer.run import main; sys.exit(main(sys.argv[1:]))" "$@"; }
CODE_MATH=(--train_sets gsm8k code_alpaca gpteacher_codegen --feature_cache_dir "$OUT/features-code-math")
for family in dfly dflash; do
  train --drafter_type $family "${CODE_MATH[@]}" --max_steps "$STEPS" --output_dir "$OUT/$family" "${COMMON[@]}" \
    >> "$OUT/$family.log" 2>&1 &
  # the first run caches the code + math features; the second starts once they are written, and reuses them
  until [ -f "$OUT/features-code-math/angelspec_features.json" ]; do sleep 10; done
done
train --drafter_type mtp --train_sets sharegpt alpaca --feature_cache_dir "$OUT/features-chat" \
  --max_steps "$CHAT_STEPS" --output_dir "$OUT/mtp" "${COMMON[@]}" >> "$OUT/mtp.log" 2>&1 &
wait
for family in dfly dflash mtp; do
  .venv/bin/python -m angelspec_hf.ship "$OUT/$family" "drafters/smollm2-135m-instruct-$family"
done
