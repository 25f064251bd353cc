#!/usr/bin/env bash
# The shipped MTP drafter, round 2: a fresh drafter in EAGLE-3's layout (so `angelspec export --format eagle3` writes
# what vLLM's Eagle3LlamaForCausalLM and SGLang's LlamaForCausalLMEagle3 load), trained on the target's regenerated
# chat replies (ShareGPT + Alpaca, 2,999 sequences) over the same pruned 8,192-token draft vocabulary as DFly, with
# hard-label CE + KL to the target's logits and 4 unrolled steps. One thread; rerunning continues from the last
# checkpoint. Then written as fp16 to drafters/. Usage: [DEVICE=auto|cpu|cuda] scripts/train_mtp_eagle3.sh [STEPS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-700}
OUT=${2:-outputs/mtp-eagle3}
mkdir -p "$OUT"
OMP_NUM_THREADS=1 .venv/bin/python -c "import sys, torch; torch.set_num_threads(1)
from angelspec_hf.trainer.run import main; sys.exit(main(sys.argv[1:]))" \
  --drafter_type mtp --config_overrides layout=eagle3 --train_sets sharegpt alpaca \
  --draft_vocab_from drafters/smollm2-135m-instruct-dfly --loss_kind ce+kl \
  --per_device_train_batch_size 4 --learning_rate 1e-3 --warmup_steps 20 --lr_scheduler_type cosine \
  --max_seq_length 384 --logging_steps 10 --save_steps 50 --save_total_limit 1 --eval_prompts 8 \
  --eval_max_new_tokens 64 --report_to tensorboard --device "${DEVICE:-auto}" --dataloader_num_workers 0 \
  --resume true --seed 0 --max_steps "$STEPS" --output_dir "$OUT/mtp" >> "$OUT/mtp.log" 2>&1
.venv/bin/python -m angelspec_hf.ship "$OUT/mtp" drafters/smollm2-135m-instruct-mtp
