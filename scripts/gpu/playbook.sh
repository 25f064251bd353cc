#!/usr/bin/env bash
# The GPU machine's runs, in one command (the last call of the plan `scripts/gpu/stage.py pack` prints):
#   bash scripts/gpu/playbook.sh
# It finishes the stage (`stage.py unpack`: stops, saying which calls are missing, when the stage is incomplete), then
# runs the parts named in PLAYBOOK_PARTS, in this order, each under its own time budget (`timeout`), writing to $OUT
# as it goes (a part cut short, or a call killed at its limit, keeps what had finished):
#   tests  `pytest -m gpu` on the test files that carry the marker               -> gpu_tests.txt
#   bench  `angelspec bench` at batch 1 and `--concurrency` (the batched engine),
#          real target, shipped drafters, per dtype in PLAYBOOK_BENCH_DTYPES       -> bench.log, bench.tar.gz
#   train  DFly from the shipped weights on all regenerated data, online target
#          features, stopped by --max_train_seconds; the result written as the
#          fp16 Hub folder `python -m angelspec_hf.ship` makes, with the run's
#          trainer_state.json (the loss log), tarred and split in 15 MiB files  -> train.log, train.tar.000, ...
# plus playbook.log (environment, timings, each part's status and tables). $OUT gets at most 7 files of <= 16 MiB
# (the device returns 8). What comes back, and where it goes in the repository: docs/gpu.md.
#
# Environment (defaults in brackets):
#   PLAYBOOK_PARTS [tests,bench,train]   PLAYBOOK_DEVICE [cuda]   PLAYBOOK_SMOKE [0: 1 = a few tokens, 2 steps]
#   PLAYBOOK_BUDGET_TESTS [60]  PLAYBOOK_BUDGET_B1 [50]  PLAYBOOK_BUDGET_BATCHED [60] (each, per dtype)
#   PLAYBOOK_BUDGET_TRAIN [120] (the whole part; training itself gets it minus PLAYBOOK_TRAIN_RESERVE [60])
#   PLAYBOOK_BENCH_DTYPES [bf16,fp32]  PLAYBOOK_TRAIN_STEPS [600]
#   PLAYBOOK_B1_ARGS / PLAYBOOK_BATCHED_ARGS / PLAYBOOK_TRAIN_ARGS: extra flags, appended (a later flag wins)
#   PLAYBOOK_STAGE [/tmp/angelspec-stage]  PLAYBOOK_SITE [/tmp/angelspec-site]  PLAYBOOK_WORK [/tmp/angelspec-work]
#   PLAYBOOK_PYTHON [python3]  PLAYBOOK_UNPACK_ARGS []  OUT [outputs/gpu-playbook, where no $OUT is set]
# Defaults: ~60 s of setup + 60 + 2 x (50 + 60) + 120 s of parts ~ 7.5 min: give the call timeout_s 540.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=${OUT:-$REPO/outputs/gpu-playbook}
PY=${PLAYBOOK_PYTHON:-python3}
STAGE=${PLAYBOOK_STAGE:-/tmp/angelspec-stage}
SITE=${PLAYBOOK_SITE:-/tmp/angelspec-site}
WORK=${PLAYBOOK_WORK:-/tmp/angelspec-work}
PARTS=${PLAYBOOK_PARTS:-tests,bench,train}
DEVICE=${PLAYBOOK_DEVICE:-cuda}
SMOKE=${PLAYBOOK_SMOKE:-0}
B_TESTS=${PLAYBOOK_BUDGET_TESTS:-60}
B_B1=${PLAYBOOK_BUDGET_B1:-50}
B_BATCHED=${PLAYBOOK_BUDGET_BATCHED:-60}
B_TRAIN=${PLAYBOOK_BUDGET_TRAIN:-120}
TRAIN_RESERVE=${PLAYBOOK_TRAIN_RESERVE:-60}
TRAIN_STEPS=${PLAYBOOK_TRAIN_STEPS:-600}
BENCH_DTYPES=${PLAYBOOK_BENCH_DTYPES:-bf16,fp32}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/playbook.log
STATUS=()

log() { echo "[playbook +${SECONDS}s] $*" | tee -a "$LOG"; }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }
# run_timed NAME BUDGET LOGFILE CMD...: CMD under `timeout`, its output appended to LOGFILE; records the status
run_timed() {
  local name=$1 budget=$2 logfile=$3 start=$SECONDS rc
  shift 3
  log "$name: start (budget ${budget}s): $*"
  timeout -k 15 "$budget" "$@" >>"$logfile" 2>&1
  rc=$?
  local what="ok"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT"
  [ $rc -ne 0 ] && [ "$what" = ok ] && what="FAILED (exit $rc)"
  STATUS+=("$name: $what in $((SECONDS - start))s")
  log "$name: $what in $((SECONDS - start))s"
  return $rc
}

log "start: parts $PARTS, device $DEVICE, smoke $SMOKE, out $OUT"
# ------------------------------------------------------------------------------------------------------- stage
# shellcheck disable=SC2086
$PY scripts/gpu/stage.py unpack --stage "$STAGE" --site "$SITE" ${PLAYBOOK_UNPACK_ARGS:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  log "stage incomplete or broken (exit $rc): nothing run"
  exit "$rc"
fi
# shellcheck disable=SC1091
source "$STAGE/env.sh"
{
  echo "--- environment"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  else
    echo "no nvidia-smi"
  fi
  $PY - <<'EOF' 2>&1
import importlib.metadata as m, platform, torch
names = ("torch", "triton", "transformers", "accelerate", "safetensors", "datasets", "pyarrow", "fsspec", "gguf")
versions = []
for n in names:
    try:
        versions.append(f"{n} {m.version(n)}")
    except m.PackageNotFoundError:
        versions.append(f"{n} -")
print(f"python {platform.python_version()}; " + ", ".join(versions))
print(f"cuda available: {torch.cuda.is_available()}" + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
EOF
} >>"$LOG"
tail -n 3 "$LOG"
# the first load dequantises the GGUF and caches the fp32 folder in $ANGELSPEC_CACHE: once, outside the budgets
run_timed "target load" 180 "$LOG" $PY -c "import time, angelspec_hf; t = time.time(); angelspec_hf.load_default_target(); print(f'target loaded and cached in {time.time() - t:.1f} s')"

# ------------------------------------------------------------------------------------------------------- tests
if wanted tests; then
  mapfile -t files < <(grep -l "mark\.gpu" tests/test_*.py)
  run_timed tests "$B_TESTS" "$OUT/gpu_tests.txt" $PY -m pytest -m gpu -q -rs -p no:cacheprovider \
    --continue-on-collection-errors "${files[@]:-tests}"
  tail -n 5 "$OUT/gpu_tests.txt" | tee -a "$LOG"
fi

# ------------------------------------------------------------------------------------------------------- bench
if wanted bench; then
  if [ "$SMOKE" = 1 ]; then
    B1=(--methods ar,dfly --sets gsm8k --prompts-per-set 1 --temperatures 0 --max-new-tokens 8)
    BATCHED=(--methods ar,dfly --concurrency 1,2 --fixed-depths 3 --requests-per-client 1 --max-new-tokens 8
             --sets gsm8k --prompts-per-set 2)
  else
    B1=(--methods ar,prompt_lookup,mtp,dflash,dfly --sets humaneval,gsm8k,mt_bench --prompts-per-set 2
        --temperatures 0 --max-new-tokens 96)
    BATCHED=(--methods ar,dfly --concurrency 1,2,4,8,16,32,64 --fixed-depths 3 --requests-per-client 1
             --max-new-tokens 64 --sets humaneval,gsm8k,mt_bench --prompts-per-set 4)
  fi
  # shellcheck disable=SC2206
  B1+=(${PLAYBOOK_B1_ARGS:-}); BATCHED+=(${PLAYBOOK_BATCHED_ARGS:-})
  for dtype in ${BENCH_DTYPES//,/ }; do
    for kind in b1 batched; do
      dir=$WORK/bench_${kind}_${dtype}
      if [ "$kind" = b1 ]; then args=("${B1[@]}"); budget=$B_B1; else args=("${BATCHED[@]}"); budget=$B_BATCHED; fi
      echo "=== bench $kind $dtype" >>"$OUT/bench.log"
      run_timed "bench $kind $dtype" "$budget" "$OUT/bench.log" $PY -m angelspec_hf.cli bench --device "$DEVICE" \
        --dtype "$dtype" --out "$dir" "${args[@]}"
      for table in "$dir/results.md" "$dir/concurrency.md"; do
        [ -f "$table" ] && cat "$table" >>"$LOG"
      done
      (cd "$WORK" && tar -czf "$OUT/bench.tar.gz" bench_* 2>/dev/null)  # everything so far, rewritten each time
    done
  done
fi

# ------------------------------------------------------------------------------------------------------- train
if wanted train; then
  seconds=$((B_TRAIN - TRAIN_RESERVE)); [ "$seconds" -lt 10 ] && seconds=10
  run_dir=$WORK/train/run
  rm -rf "$WORK/train"; mkdir -p "$WORK/train"
  if [ "$SMOKE" = 1 ]; then
    SIZE=(--max_steps 2 --per_device_train_batch_size 2 --max_seq_length 128 --num_anchors 8 --max_train_samples 16
          --logging_steps 1 --save_steps 1 --eval_prompts 1 --eval_max_new_tokens 8)
  else
    SIZE=(--max_steps "$TRAIN_STEPS" --per_device_train_batch_size 32 --max_seq_length 768 --num_anchors 128
          --logging_steps 10 --save_steps 100 --eval_prompts 8 --eval_max_new_tokens 64)
  fi
  # shellcheck disable=SC2206
  EXTRA=(${PLAYBOOK_TRAIN_ARGS:-})
  # the CPU recipe (scripts/train_release.sh): batch 4, 384 tokens, 64 anchors, 3 code + math sets
  run_timed train "$B_TRAIN" "$OUT/train.log" $PY -m angelspec_hf.cli train --drafter_type dfly \
    --init_drafter drafters/smollm2-135m-instruct-dfly --output_dir "$run_dir" --device "$DEVICE" --dtype bf16 \
    --bf16 true --train_sets gsm8k code_alpaca gpteacher_codegen sharegpt alpaca --feature_mode online \
    --resample_anchors true --loss_kind ce+kl --learning_rate 3e-4 --warmup_steps 20 --lr_scheduler_type cosine \
    --save_total_limit 1 --report_to none --dataloader_num_workers 0 --seed 0 --max_train_seconds "$seconds" \
    "${SIZE[@]}" "${EXTRA[@]}"
  # the final drafter, else (a run killed at its budget) the last checkpoint, as the fp16 Hub folder
  source=$run_dir
  [ -f "$run_dir/model.safetensors" ] || source=$(ls -d "$run_dir"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -n 1)
  if [ -n "$source" ] && [ -f "$source/model.safetensors" ]; then
    $PY -m angelspec_hf.ship "$source" "$WORK/train/dfly-gpu" >>"$OUT/train.log" 2>&1
    cp "$source/trainer_state.json" "$WORK/train/dfly-gpu/trainer_state.json" 2>/dev/null || true
    echo "from: $source" >"$WORK/train/dfly-gpu/SOURCE.txt"
    rm -f "$OUT"/train.tar.*
    (cd "$WORK/train" && tar -cf - dfly-gpu | split -b 15M -d -a 3 - "$OUT/train.tar.")
    log "train: shipped $source as $WORK/train/dfly-gpu -> $(ls "$OUT"/train.tar.* | xargs -n1 basename | tr '\n' ' ')"
    $PY - "$WORK/train/dfly-gpu/trainer_state.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    state = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no trainer_state.json")
logs = state["log_history"]
losses = [(h["step"], h["loss"]) for h in logs if "loss" in h]
taus = {k: v for h in logs for k, v in h.items() if k.startswith("tau/")}
print(f"train: {state['global_step']} steps; loss {losses[0][1]:.4f} (step {losses[0][0]}) -> {losses[-1][1]:.4f} "
      f"(step {losses[-1][0]}); " + ", ".join(f"{k} {v:.2f}" for k, v in taus.items()) if losses else "no loss logged")
EOF
  else
    log "train: no drafter to ship (no final model, no checkpoint)"
  fi
fi

# ----------------------------------------------------------------------------------------------------- summary
log "done in ${SECONDS}s"
for line in "${STATUS[@]}"; do echo "  $line" | tee -a "$LOG"; done
n=0
for f in "$OUT"/*; do
  size=$(stat -c %s "$f"); n=$((n + 1))
  echo "  $(basename "$f") $size bytes$([ "$size" -gt 16777216 ] && echo ' OVER 16 MiB: will not come back')" | tee -a "$LOG"
done
[ "$n" -gt 8 ] && log "WARNING: $n files under \$OUT; the device returns at most 8"
for line in "${STATUS[@]}"; do [[ "$line" == *": ok in "* ]] || exit 1; done
exit 0
