#!/usr/bin/env bash
# The GPU machine's runs, in one command (the last call of the plan `scripts/gpu/stage.py pack` prints):
#   bash scripts/gpu/playbook.sh
# It finishes the stage (`stage.py unpack`: stops, saying which calls are missing, when the stage is incomplete), then
# runs the parts named in PLAYBOOK_PARTS, always in this order (training first: trained drafters are what the
# machine's scarce time buys most of; the measurements after it), each under its own time budget (`timeout`), writing
# to $OUT as it goes (a part cut short, or a call killed at its limit, keeps what had finished):
#   train  the drafter families in PLAYBOOK_TRAIN_FAMILIES, one after another (dfly, dflash, mtp), each from the
#          shipped weights or, where the stage holds a previous GPU period's result (`stage.py pack --init-from`),
#          from that; online target features, GPU-sized batches, stopped by --max_train_seconds at its share of
#          the budget; held-out τ logged (tau/held_out, the 12 held-out TRAIN prompts of the CPU runs) at the
#          start, every 200 steps and at the end. DFlash runs at equal budget with this call's DFly: the same
#          data, batch, anchors, seed and schedule, stopped at DFly's step count (--stop_at_step). MTP (EAGLE-3
#          layout) trains on the chat sets. Each result is the fp16 Hub folder `python -m angelspec_hf.ship`
#          makes (DFlash with --full-vocab) plus trainer_state.json and gpu_training.json (this and every
#          earlier GPU period: steps, blocks, seconds, device, held-out τ); all of them in one tar.gz, split in
#          15 MiB files and rewritten after each family                          -> train.log, train.tar.gz.000, ...
#   tests  `pytest -m gpu` on the test files that carry the marker, then
#          `benchmarks/paged_attention.py` (kernel vs gather + SDPA)            -> gpu_tests.txt
#   bench  `angelspec bench` at batch 1 and `--concurrency` (the batched engine),
#          real target, shipped drafters, per dtype in PLAYBOOK_BENCH_DTYPES       -> bench.log, bench.tar.gz
# plus playbook.log (environment, timings, each part's status and tables). With every part and three families $OUT
# gets 8 files of <= 16 MiB (3 train pieces: ~42 MiB of fp16 drafters, gzip'd); over 8 (what the device returns),
# the playbook says so loudly and at its end folds the text logs into logs.tar.gz. What comes back, and where it goes
# in the repository (`stage.py receive`): docs/gpu.md.
#
# Environment (defaults in brackets):
#   PLAYBOOK_PARTS [train,tests,bench]   PLAYBOOK_DEVICE [cuda]   PLAYBOOK_SMOKE [0: 1 = a few tokens, 2 steps]
#   PLAYBOOK_BUDGET_TESTS [60]  PLAYBOOK_BUDGET_KERNELS [45]  PLAYBOOK_BUDGET_B1 [50]  PLAYBOOK_BUDGET_BATCHED [60] (each, per dtype)
#   PLAYBOOK_TRAIN_FAMILIES [dfly] (any of dfly dflash mtp, spaces or commas)
#   PLAYBOOK_BUDGET_TRAIN [240 for one family, 150 a family for more] (the whole part; each family gets its share
#     of what is left when it starts, and trains for that less PLAYBOOK_TRAIN_RESERVE [60] for loading the data, the
#     final eval and shipping; a share that leaves under 10 s is not run)
#   PLAYBOOK_TRAIN_SHARES [equal] e.g. "dfly=2,dflash=2,mtp=1"
#   PLAYBOOK_TRAIN_STEPS [4000] (at most this many steps: the fitted cosine ends where the time does, before it)
#   PLAYBOOK_TRAIN_LR [3e-4]  PLAYBOOK_TRAIN_SEED [the period: 1 + the periods the previous results recorded]
#   PLAYBOOK_INIT_DIR [$PLAYBOOK_STAGE/init] (where <family>-gpu/ previous results are looked for; on a warm
#     machine, $PLAYBOOK_WORK/train-previous continues from the last call's result)
#   PLAYBOOK_BENCH_DTYPES [bf16]  PLAYBOOK_CALL_LIMIT [540] (the planned budgets are checked against it)
#   PLAYBOOK_B1_ARGS / PLAYBOOK_BATCHED_ARGS / PLAYBOOK_TRAIN_ARGS (every family) / PLAYBOOK_TRAIN_ARGS_DFLY (DFly and
#     DFlash) / PLAYBOOK_TRAIN_ARGS_DFLASH / PLAYBOOK_TRAIN_ARGS_MTP: extra flags, appended (a later flag wins)
#   PLAYBOOK_STAGE [/tmp/angelspec-stage]  PLAYBOOK_SITE [/tmp/angelspec-site]  PLAYBOOK_WORK [/tmp/angelspec-work]
#   PLAYBOOK_PYTHON [python3]  PLAYBOOK_UNPACK_ARGS []  OUT [outputs/gpu-playbook, where no $OUT is set]
# Defaults: ~60 s of setup + 240 (DFly: 180 s of training) + 60 + 45 + 50 + 60 s of parts ~ 8.6 min: give the call
# timeout_s 540. fp32's bench is a call of its own on the warm machine (the stage stays in /tmp; carry nothing):
#   PLAYBOOK_PARTS=bench PLAYBOOK_BENCH_DTYPES=fp32 bash scripts/gpu/playbook.sh      (~60 + 110 s: timeout_s 240)
# Three families do not fit beside the tests and the bench; a training call:
#   PLAYBOOK_PARTS=train PLAYBOOK_TRAIN_FAMILIES="dfly dflash mtp" PLAYBOOK_BUDGET_TRAIN=450 bash scripts/gpu/playbook.sh
# ~60 s of setup + 3 x 150 s (90 s of training each) ~ 8.5 min, also timeout_s 540.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=${OUT:-$REPO/outputs/gpu-playbook}
PY=${PLAYBOOK_PYTHON:-python3}
STAGE=${PLAYBOOK_STAGE:-/tmp/angelspec-stage}
SITE=${PLAYBOOK_SITE:-/tmp/angelspec-site}
WORK=${PLAYBOOK_WORK:-/tmp/angelspec-work}
PARTS=${PLAYBOOK_PARTS:-train,tests,bench}
DEVICE=${PLAYBOOK_DEVICE:-cuda}
SMOKE=${PLAYBOOK_SMOKE:-0}
B_TESTS=${PLAYBOOK_BUDGET_TESTS:-60}
B_KERNELS=${PLAYBOOK_BUDGET_KERNELS:-45}
B_B1=${PLAYBOOK_BUDGET_B1:-50}
B_BATCHED=${PLAYBOOK_BUDGET_BATCHED:-60}
TRAIN_RESERVE=${PLAYBOOK_TRAIN_RESERVE:-60}
TRAIN_STEPS=${PLAYBOOK_TRAIN_STEPS:-4000}
TRAIN_LR=${PLAYBOOK_TRAIN_LR:-3e-4}
MIN_TRAIN=10
INIT_DIR=${PLAYBOOK_INIT_DIR:-$STAGE/init}
BENCH_DTYPES=${PLAYBOOK_BENCH_DTYPES:-bf16}
CALL_LIMIT=${PLAYBOOK_CALL_LIMIT:-540}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/playbook.log
STATUS=()

log() { echo "[playbook +${SECONDS}s] $*" | tee -a "$LOG"; }
# the families to train, in the order they run (dfly first: DFlash matches its steps), and their shares of the budget
declare -A WEIGHT=([dfly]=1 [dflash]=1 [mtp]=1)
FAMILIES=()
named=" ${PLAYBOOK_TRAIN_FAMILIES:-dfly} "; named=${named//,/ }
for f in $named; do
  case $f in dfly|dflash|mtp) ;; *) log "PLAYBOOK_TRAIN_FAMILIES: unknown family '$f' (dfly, dflash, mtp)"; exit 2 ;; esac
done
for f in dfly dflash mtp; do [[ "$named" == *" $f "* ]] && FAMILIES+=("$f"); done
shares=${PLAYBOOK_TRAIN_SHARES:-}
for pair in ${shares//,/ }; do
  f=${pair%%=*}; w=${pair#*=}
  if [[ ! "$f" =~ ^(dfly|dflash|mtp)$ ]] || [[ ! "$w" =~ ^[1-9][0-9]*$ ]] || [ "$pair" = "$f" ]; then
    log "PLAYBOOK_TRAIN_SHARES: expected FAMILY=WEIGHT pairs (a whole number >= 1), got '$pair'"; exit 2
  fi
  WEIGHT[$f]=$w
done
default_train=240; [ ${#FAMILIES[@]} -gt 1 ] && default_train=$((150 * ${#FAMILIES[@]}))
B_TRAIN=${PLAYBOOK_BUDGET_TRAIN:-$default_train}
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
# the budgets against the call's timeout_s: setup (unpack, pip, the target's first load) takes about a minute
planned=60
wanted tests && planned=$((planned + B_TESTS + B_KERNELS))
wanted bench && for dtype in ${BENCH_DTYPES//,/ }; do planned=$((planned + B_B1 + B_BATCHED)); done
wanted train && planned=$((planned + B_TRAIN))
log "budgets: ${planned}s planned, setup included, of the call's ${CALL_LIMIT}s"
if [ "$planned" -gt "$CALL_LIMIT" ]; then
  log "!!! WARNING: the parts' budgets and ~60 s of setup add up to ${planned}s, over the call's ${CALL_LIMIT}s: the" \
      "call may be killed before the last part ends. Run training as its own call (docs/gpu.md): PLAYBOOK_PARTS=train" \
      "PLAYBOOK_TRAIN_FAMILIES=\"${FAMILIES[*]}\" PLAYBOOK_BUDGET_TRAIN=$((CALL_LIMIT - 90))"
fi
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
part_tests() {
  mapfile -t files < <(grep -l "mark\.gpu" tests/test_*.py)
  run_timed tests "$B_TESTS" "$OUT/gpu_tests.txt" $PY -m pytest -m gpu -q -rs -p no:cacheprovider \
    --continue-on-collection-errors "${files[@]:-tests}"
  tail -n 5 "$OUT/gpu_tests.txt" | tee -a "$LOG"
  # the paged-attention kernel against the gather + SDPA it replaces on CUDA (batch 1-64, context 256-2048, bf16)
  SIZES=(); [ "$SMOKE" = 1 ] && SIZES=(--batch 1,2 --context 32 --new 1,4 --repeats 2)
  run_timed attention_bench "$B_KERNELS" "$OUT/gpu_tests.txt" $PY benchmarks/paged_attention.py \
    --device "$DEVICE" "${SIZES[@]}"
  tail -n 40 "$OUT/gpu_tests.txt" | grep "|" | tee -a "$LOG"
}

# ------------------------------------------------------------------------------------------------------- bench
part_bench() {
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
}

# ------------------------------------------------------------------------------------------------------- train
# one family after another, in the order dfly, dflash, mtp (DFlash matches the steps DFly made); each gets its share
# of what is left of the train budget, and a share below the reserve + MIN_TRAIN seconds is not run
part_train() {
  train_start=$SECONDS
  # a warm machine's previous result stays readable: PLAYBOOK_INIT_DIR=$WORK/train-previous continues from it
  if [ -d "$WORK/train/ship" ]; then rm -rf "$WORK/train-previous"; mv "$WORK/train/ship" "$WORK/train-previous"; fi
  rm -rf "$WORK/train"; mkdir -p "$WORK/train/ship"
  rm -f "$OUT"/train.tar*
  RESULTS=(scripts/gpu/results.py)
  if [ "$DEVICE" = cpu ]; then device_name="cpu (rehearsal)"
  else device_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1); fi
  seed=${PLAYBOOK_TRAIN_SEED:-$($PY "${RESULTS[@]}" period "$INIT_DIR" "${FAMILIES[@]}")}
  plan=""
  for f in "${FAMILIES[@]}"; do
    from=shipped; [ -f "$INIT_DIR/$f-gpu/model.safetensors" ] && from="previous GPU result"
    plan+=" $f (share ${WEIGHT[$f]}, from $from)"
  done
  log "train: budget ${B_TRAIN}s, reserve ${TRAIN_RESERVE}s a family, seed $seed:$plan"
  if [ "$SMOKE" = 1 ]; then
    SIZE=(--max_steps 2 --per_device_train_batch_size 2 --max_seq_length 128 --max_train_samples 16 --logging_steps 1
          --save_steps 1 --eval_steps 2 --eval_prompts 2 --eval_max_new_tokens 8)
    ANCHORS=8; BATCH=2; STEPS=2; BLOCK_SETS=(code_alpaca); MTP_SETS=(alpaca)
  else
    SIZE=(--max_steps "$TRAIN_STEPS" --per_device_train_batch_size 32 --max_seq_length 768 --logging_steps 10
          --save_steps 100 --eval_steps 200 --eval_prompts 12 --eval_max_new_tokens 64)
    ANCHORS=128; BATCH=32; STEPS=$TRAIN_STEPS
    BLOCK_SETS=(gsm8k code_alpaca gpteacher_codegen sharegpt alpaca); MTP_SETS=(sharegpt alpaca)
  fi
  # the CPU recipes (scripts/train_release.sh, scripts/train_mtp_eagle3.sh): batch 4, 384 tokens, 64/128 anchors
  COMMON=(--device "$DEVICE" --dtype bf16 --bf16 true --feature_mode online --loss_kind ce+kl
          --learning_rate "$TRAIN_LR" --warmup_steps 20 --lr_scheduler_type cosine --fit_schedule_to_time true
          --save_total_limit 1
          --report_to none --dataloader_num_workers 0 --seed "$seed" --eval_prompts_from held_out
          --draft_vocab_from drafters/smollm2-135m-instruct-dfly "${SIZE[@]}")
  # shellcheck disable=SC2206
  EXTRA=(${PLAYBOOK_TRAIN_ARGS:-})
  for i in "${!FAMILIES[@]}"; do
    fam=${FAMILIES[$i]}
    left=$((B_TRAIN - (SECONDS - train_start))); wsum=0
    for f in "${FAMILIES[@]:$i}"; do wsum=$((wsum + WEIGHT[$f])); done
    budget=$((left * WEIGHT[$fam] / wsum)); seconds=$((budget - TRAIN_RESERVE))
    if [ "$seconds" -lt "$MIN_TRAIN" ]; then
      log "!!! train $fam: NOT RUN: its share is ${budget}s, which leaves ${seconds}s of training after the" \
          "${TRAIN_RESERVE}s reserve (at least ${MIN_TRAIN}s): raise PLAYBOOK_BUDGET_TRAIN or train fewer families"
      STATUS+=("train $fam: NOT RUN (share ${budget}s)"); continue
    fi
    init=drafters/smollm2-135m-instruct-$fam; init_label=$init
    if [ -f "$INIT_DIR/$fam-gpu/model.safetensors" ]; then init=$INIT_DIR/$fam-gpu; init_label="previous GPU result ($init)"; fi
    run_dir=$WORK/train/$fam; ship_dir=$WORK/train/ship/$fam-gpu
    # shellcheck disable=SC2206
    OWN=(${PLAYBOOK_TRAIN_ARGS_DFLY:-})  # DFlash trains with DFly's flags: the same recipe, for a fair comparison
    match=(); anchors=$ANCHORS; schedule=$STEPS
    case $fam in
      dfly) FAMILY_ARGS=(--train_sets "${BLOCK_SETS[@]}" --num_anchors "$ANCHORS" --resample_anchors true) ;;
      dflash)
        FAMILY_ARGS=(--train_sets "${BLOCK_SETS[@]}" --num_anchors "$ANCHORS" --resample_anchors true)
        if [ -f "$WORK/train/ship/dfly-gpu/gpu_training.json" ]; then
          dfly_steps=$($PY "${RESULTS[@]}" steps "$WORK/train/ship/dfly-gpu")
          schedule=$($PY "${RESULTS[@]}" schedule-steps "$WORK/train/ship/dfly-gpu")
          # DFly's schedule, as a step schedule of the length its time budget gave it: the same rate at every step
          match=(--stop_at_step "$dfly_steps" --max_steps "$schedule" --fit_schedule_to_time false)
          log "train dflash: at equal budget with this run's DFly: the same data, batch, anchors, seed and schedule" \
              "($schedule steps), stopped at its step $dfly_steps"
        else
          log "train dflash: no DFly result in this run: trained for its time share, not an equal-budget comparison"
        fi
        # shellcheck disable=SC2206
        OWN+=(${PLAYBOOK_TRAIN_ARGS_DFLASH:-}) ;;
      mtp)
        FAMILY_ARGS=(--train_sets "${MTP_SETS[@]}"); anchors=""
        # shellcheck disable=SC2206
        OWN=(${PLAYBOOK_TRAIN_ARGS_MTP:-}) ;;
    esac
    echo "=== train $fam ($init_label)" >>"$OUT/train.log"
    fam_start=$SECONDS
    run_timed "train $fam" "$budget" "$OUT/train.log" $PY -m angelspec_hf.cli train --drafter_type "$fam" \
      --init_drafter "$init" --output_dir "$run_dir" --max_train_seconds "$seconds" "${COMMON[@]}" \
      "${FAMILY_ARGS[@]}" "${match[@]}" "${EXTRA[@]}" "${OWN[@]}"
    # the final drafter, else (a run killed at its budget) the last checkpoint, as the fp16 Hub folder
    source=$($PY "${RESULTS[@]}" source "$run_dir")
    if [ -z "$source" ]; then
      log "train $fam: no drafter to ship (no final model, no checkpoint)"; continue
    fi
    full=(); [ "$fam" = dflash ] && full=(--full-vocab)  # the shipped DFlash drafts over the whole vocabulary
    if ! $PY -m angelspec_hf.ship "$source" "$ship_dir" "${full[@]}" >>"$OUT/train.log" 2>&1; then
      log "!!! train $fam: shipping $source failed (train.log)"; STATUS+=("ship $fam: FAILED"); continue
    fi
    $PY "${RESULTS[@]}" record "$fam" --run-dir "$run_dir" --ship-dir "$ship_dir" --init "$init" \
      --init-label "$init_label" --device "$device_name" --batch "$BATCH" ${anchors:+--anchors "$anchors"} \
      --max-steps "$schedule" --seed "$seed" ${match[1]:+--stop-at-step "${match[1]}"} \
      --wall-seconds "$((SECONDS - fam_start))" \
      --train-args "${COMMON[*]} ${FAMILY_ARGS[*]} ${match[*]} ${EXTRA[*]} ${OWN[*]}" 2>&1 | tee -a "$LOG"
    # every family shipped so far, rewritten after each: a call cut short still returns the finished ones
    $PY "${RESULTS[@]}" pack-out "$WORK/train/ship" "$OUT" 2>&1 | tee -a "$LOG"
  done
}

# training first (the drafters are what the machine's time buys most of), then the measurements
for part in train tests bench; do wanted $part && part_$part; done

# ----------------------------------------------------------------------------------------------------- summary
log "done in ${SECONDS}s"
for line in "${STATUS[@]}"; do echo "  $line" | tee -a "$LOG"; done
# the device returns at most 8 files: over that, the text logs go into one logs.tar.gz (playbook.log stays)
folded=$($PY scripts/gpu/results.py fold-logs "$OUT" 2>&1)
[ -n "$folded" ] && log "!!! more than 8 files under \$OUT: folded $folded into logs.tar.gz"
n=0
for f in "$OUT"/*; do
  size=$(stat -c %s "$f"); n=$((n + 1))
  echo "  $(basename "$f") $size bytes$([ "$size" -gt 16777216 ] && echo ' OVER 16 MiB: will not come back')" | tee -a "$LOG"
done
[ "$n" -gt 8 ] && log "!!! WARNING: $n files under \$OUT; the device returns at most 8: some will not come back"
for line in "${STATUS[@]}"; do [[ "$line" == *": ok in "* ]] || exit 1; done
exit 0
