#!/usr/bin/env bash
# Ablations of issue #13, one table: every run starts from a fresh drafter (same seed, data, steps, batch, anchors,
# block 8, pruned 8,192-token draft vocabulary) and changes one thing against the DFly reference:
#   dfly           DFly as shipped: per-layer fusion + AR head, CE + KL, anchors redrawn every step
#   dflash         DFlash (no fusion, no AR head)            dfly-noar      DFly without its AR head
#   dfly-nofusion  DFly without per-layer fusion             dfly-ce        hard-label CE only (no KL)
#   dfly-fixed     the same anchors every epoch (seeded per example)
# The runs go one after another on one thread; rerunning continues each from its last checkpoint. τ and first-token
# acceptance at the end (8 EVAL prompts per set, 64 tokens, whole blocks) are then tabulated by
# `python scripts/ablation_table.py OUT`.
# Usage: [DEVICE=auto|cpu|cuda] scripts/train_ablation.sh [STEPS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-200}
OUT=${2:-outputs/ablation}
mkdir -p "$OUT"
COMMON=(--per_device_train_batch_size 4 --learning_rate 1e-3 --warmup_steps 10 --lr_scheduler_type cosine
        --max_seq_length 384 --num_anchors 32 --logging_steps 10 --save_steps 50 --save_total_limit 1
        --eval_steps "$STEPS" --eval_prompts 8 --eval_max_new_tokens 64 --report_to none --device "${DEVICE:-auto}"
        --dataloader_num_workers 0 --resume true --seed 0 --max_steps "$STEPS"
        --train_sets gsm8k code_alpaca gpteacher_codegen --draft_vocab_from drafters/smollm2-135m-instruct-dfly)
train() { OMP_NUM_THREADS=1 .venv/bin/python -c "import sys, torch; torch.set_num_threads(1)
from angelspec_hf.trainer.run import main; sys.exit(main(sys.argv[1:]))" "$@"; }
run() {  # name, then the flags that make it differ from the reference
  local name=$1; shift
  train --output_dir "$OUT/$name" "${COMMON[@]}" "$@" >> "$OUT/$name.log" 2>&1
}
run dfly          --drafter_type dfly   --loss_kind ce+kl --resample_anchors true
run dflash        --drafter_type dflash --loss_kind ce+kl --resample_anchors true
run dfly-noar     --drafter_type dfly   --loss_kind ce+kl --resample_anchors true --config_overrides use_ar_head=false
run dfly-nofusion --drafter_type dfly   --loss_kind ce+kl --resample_anchors true --config_overrides use_layer_fusion=false
run dfly-ce       --drafter_type dfly   --loss_kind ce    --resample_anchors true
run dfly-fixed    --drafter_type dfly   --loss_kind ce+kl --resample_anchors false
