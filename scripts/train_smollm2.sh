#!/usr/bin/env bash
# Train MTP, DFlash and DFly drafters for the embedded SmolLM2-135M-Instruct target on the regenerated data in
# data/regenerated/ (co-specialised: DFly and DFlash on identical code + math data and steps, MTP on chat).
# DFly and DFlash run side by side, one thread each; then MTP.
# Usage: [DEVICE=auto|cpu|cuda] scripts/train_smollm2.sh [STEPS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-120}
OUT=${2:-outputs/runs}
mkdir -p "$OUT"
COMMON=(--max_steps "$STEPS" --per_device_train_batch_size 4 --learning_rate 1e-3 --warmup_steps 10
        --max_seq_length 384 --num_anchors 16 --logging_steps 10 --save_steps 40 --report_to tensorboard
        --device "${DEVICE:-auto}" --eval_prompts 4 --eval_max_new_tokens 64 --dataloader_num_workers 0)
train() { OMP_NUM_THREADS=1 .venv/bin/python -c "import sys, torch; torch.set_num_threads(1)
from angelspec_hf.trainer.run import main; sys.exit(main(sys.argv[1:]))" "$@"; }
CODE_MATH=(--train_sets gsm8k code_alpaca gpteacher_codegen)
train --drafter_type dfly "${CODE_MATH[@]}" --output_dir "$OUT/dfly" "${COMMON[@]}" > "$OUT/dfly.log" 2>&1 &
train --drafter_type dflash "${CODE_MATH[@]}" --output_dir "$OUT/dflash" "${COMMON[@]}" > "$OUT/dflash.log" 2>&1 &
wait
train --drafter_type mtp --train_sets sharegpt alpaca --output_dir "$OUT/mtp" "${COMMON[@]}" > "$OUT/mtp.log" 2>&1
grep -h -A4 "| eval set" "$OUT"/{dfly,dflash,mtp}/README.md
