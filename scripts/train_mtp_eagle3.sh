#!/usr/bin/env bash
# The shipped MTP drafter, round 2: a fresh drafter in EAGLE-3's layout (so `angelspec export --format eagle3` writes
# what vLLM's Eagle3LlamaForCausalLM and SGLang's LlamaForCausalLMEagle3 load), trained on the target's regenerated
# chat replies (ShareGPT + Alpaca, 2,999 sequences) over the same pruned 8,192-token draft vocabulary as DFly, with
# hard-label CE + KL to the target's logits and 4 unrolled steps. One thread; rerunning continues from the last
# checkpoint. Then written as fp16 to drafters/. Usage: [DEVICE=auto|cpu|cuda] scripts/train_mtp_eagle3.sh [STEPS] [OUT]
#
# INIT=<drafter folder> continues a trained MTP drafter instead (e.g. the shipped one) with the CPU defaults of
# scripts/train_release.sh: the target's states stored per sequence as the first epoch reads them and read back later
# (--feature_mode filling, in STATES, default <OUT>/target-states), the drafter's training forward compiled (in
# fp32), the target's training forward on a compiled bf16 copy; held-out τ on 12 held-out ShareGPT + Alpaca TRAIN
# prompts logged before the first step and every 250 steps (`scripts/tau_by_training.py --from-logs`); peak learning
# rate LR (default 2e-4 when continuing). MAX_SECONDS=N ends a piece after N seconds of training with a checkpoint;
# rerunning the same command continues it. SHIP=0 leaves drafters/ alone. THREADS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-700}
OUT=${2:-outputs/mtp-eagle3}
THREADS=${THREADS:-1}
mkdir -p "$OUT"
if [ -n "${INIT:-}" ]; then
  START=(--init_drafter "$INIT" --target_states_dtype bfloat16 --compile_target_states true
         --compile_drafter true --feature_mode filling --feature_cache_dir "${STATES:-$OUT/target-states}"
         --eval_steps 250 --eval_prompts 12 --eval_prompts_from held_out --train_sampling_strategy group_by_length)
  LR=${LR:-2e-4}
else
  START=(--config_overrides layout=eagle3 --eval_prompts 8)
  LR=${LR:-1e-3}
fi
LIMIT=(); [ -n "${MAX_SECONDS:-}" ] && LIMIT=(--max_train_seconds "$MAX_SECONDS")
OMP_NUM_THREADS=$THREADS .venv/bin/python -c "import sys, torch; torch.set_num_threads($THREADS)
from angelspec_hf.trainer.run import main; sys.exit(main(sys.argv[1:]))" \
  --drafter_type mtp "${START[@]}" --train_sets sharegpt alpaca \
  --draft_vocab_from drafters/smollm2-135m-instruct-dfly --loss_kind ce+kl "${LIMIT[@]}" \
  --per_device_train_batch_size 4 --learning_rate "$LR" --warmup_steps 20 --lr_scheduler_type cosine \
  --max_seq_length 384 --logging_steps 10 --save_steps 50 --save_total_limit 1 \
  --eval_max_new_tokens 64 --report_to tensorboard --device "${DEVICE:-auto}" --dataloader_num_workers 0 \
  --resume true --seed "${SEED:-0}" --max_steps "$STEPS" --output_dir "$OUT/mtp" >> "$OUT/mtp.log" 2>&1
[ "${SHIP:-1}" = 1 ] || exit 0
.venv/bin/python -m angelspec_hf.ship "$OUT/mtp" drafters/smollm2-135m-instruct-mtp
