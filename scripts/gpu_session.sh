#!/usr/bin/env bash
# Everything a GPU session needs in one device call, logs under $OUT.
#   bash scripts/gpu_session.sh install test sweep bench     (any subset of steps, in order)
#   bench_base: the same benchmark code (this tree's attnfuse/bench) on the kernels in .base (attnfuse/ and
#   attnfuse_plugins/ of an earlier commit, with this tree's attnfuse/bench copied in:
#   `bash scripts/base_tree.sh REV`, then carry .base), for before/after tables from one call.
#   sanitize: every combinator's fixed cases under compute-sanitizer (WORKERS processes at once).
#   float32: the float32 FMA tiles' GPU test, then their sweep against the table's tiles.
#   templates: the template instances' GPU check; writes $OUT/verified.json, the record to check in
#   (TEMPLATES_K: a pytest -k expression choosing some of its cases).
# Knobs: PROFILE_ARGS (see benchmarks/profile_training.py), HF_ARGS (see benchmarks/hf_layer.py), HF_GEN_ARGS (see benchmarks/hf_generate.py), LAYER_STEPS_ARGS (see benchmarks/layer_steps.py; --timing 8192), SWEEP_ARGS (more sweep_tiles.py arguments), TESTS (pytest paths), WORKERS (pytest-xdist processes; 4), MAXFAIL (failures before pytest stops; 1), FUZZ (examples per combinator), SWEEP_CASES / SWEEP_KERNEL (see
# benchmarks/sweep_tiles.py), BENCH_ARGS (see `attnfuse bench --help`), BENCH_NAME (the
# files' name under $OUT; bench), BENCH_PLOT (set: draw the plot), STEP_TIMEOUT (seconds
# per step, so one step cannot use up the device call; 0, the default, is none).
set -uo pipefail
OUT=${OUT:-/tmp/attnfuse-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export ATTNFUSE_TEST_LOG="$OUT/tests.log"  # each test's outcome as it happens, failures' reports (tests/conftest.py)
cd "$(dirname "$0")/.."
# the device returns at most 8 files from $OUT: more than that leave it as one archive, session.tgz
dmon_pid=
finish() {
  [ -n "$dmon_pid" ] && kill "$dmon_pid" 2>/dev/null
  if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -C "$OUT" -czf /tmp/session.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/session.tgz "$OUT/"
  fi
}
trap finish EXIT
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    install)
      python3 -m pip install -q --no-deps --no-build-isolation -e . $(printf -- '-e %s ' contrib/*/) \
        >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
      nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
        | tee "$OUT/gpu.txt" ;;
    test)
      # WORKERS pytest-xdist processes share the GPU: the tests' time is mostly kernel compiles, on the CPUs
      ATTNFUSE_FUZZ_EXAMPLES=${FUZZ:-40} timeout "${STEP_TIMEOUT:-0}" python3 -m pytest -q -rfE -n ${WORKERS:-4} \
        --maxfail=${MAXFAIL:-1} -p no:cacheprovider \
        ${TESTS:-tests/test_gpu.py tests/test_conformance.py} 2>&1 | tee "$OUT/pytest.log" | tail -25 ;;
    sanitize)
      # every combinator's fixed cases under compute-sanitizer: a read outside a tensor, even one that does not fault
      timeout "${STEP_TIMEOUT:-0}" python3 scripts/sanitize_fixed_cases.py 2>&1 | tee "$OUT/sanitize.log" | tail -30 ;;
    templates)
      # every template instance against float64 (tests/test_template_gpu.py), then the record of those that passed
      rm -rf /tmp/attnfuse-verify
      ATTNFUSE_VERIFY_OUT=/tmp/attnfuse-verify ATTNFUSE_TEMPLATES=all timeout "${STEP_TIMEOUT:-0}" python3 -m pytest -q \
        -rfE -n ${WORKERS:-4} -p no:cacheprovider ${TEMPLATES_K:+-k "$TEMPLATES_K"} tests/test_template_gpu.py 2>&1 \
        | tee "$OUT/templates.log" | tail -40
      # a run stopped by STEP_TIMEOUT left cases unrun: no record from it
      if [ "${PIPESTATUS[0]}" -ne 124 ]; then
        # some cases (TEMPLATES_K): their instances added to the checked-in record
        python3 -m attnfuse.kernels.verify --collect /tmp/attnfuse-verify --write "$OUT/verified.json" \
          ${TEMPLATES_K:+--add-to attnfuse/kernels/verified.json}
        # the instances no case runs any more (an earlier source of a changed instance) leave the record
        python3 -m attnfuse.kernels.verify --prune --write "$OUT/verified.json"
      else
        echo "templates: stopped at STEP_TIMEOUT, so no record is written"
      fi ;;
    sweep)
      (cd benchmarks && timeout "${STEP_TIMEOUT:-0}" python3 sweep_tiles.py --kernel "${SWEEP_KERNEL:-forward}" ${SWEEP_CASES:+--cases $SWEEP_CASES} ${SWEEP_ARGS:-}) \
        2>&1 | tee "$OUT/sweep.log" | grep -E "BEST|failed|Error" ;;
    bench)
      name=${BENCH_NAME:-bench}
      timeout "${STEP_TIMEOUT:-0}" python3 -m attnfuse.cli bench ${BENCH_ARGS:-} --markdown "$OUT/$name.md" \
        --json "$OUT/$name.json" ${BENCH_PLOT:+--plot "$OUT/$name.png"} 2>&1 | tee "$OUT/$name.log" ;;
    packed|fp8|dropout)
      # a feature gated by architecture (runtime/gpu_gate.py): its GPU test, and only once that passes, its
      # bench suite with the feature's gate open (needed on an architecture not in the gate's checked)
      case $step in
        packed) tests="tests/test_gpu.py -k packed_sequences"; env=ATTNFUSE_PACKED_ON_GPU ;;
        fp8) tests="tests/test_fp8.py -k on_a_gpu"; env=ATTNFUSE_FP8_ON_GPU ;;
        dropout) tests="tests/test_gpu.py -k dropout_replays"; env=ATTNFUSE_DROPOUT_ON_GPU ;;
      esac
      if timeout "${STEP_TIMEOUT:-0}" python3 -m pytest -q -rfE -p no:cacheprovider $tests 2>&1 \
        | tee "$OUT/${step}_test.log" | tail -5; [ "${PIPESTATUS[0]}" -eq 0 ]; then
        env "$env=1" timeout "${STEP_TIMEOUT:-0}" python3 -m attnfuse.cli bench --suite "$step" \
          --markdown "$OUT/$step.md" --json "$OUT/$step.json" 2>&1 | tee "$OUT/$step.log"
      else
        echo "$step: the GPU check failed, so the $step suite did not run"
      fi ;;
    float32)
      # IEEE float32's FMA tiles (passes.tile.FLOAT32_FMA_TILES): their GPU test, and only once that passes, a sweep
      # of them against the table's tiles (forward; then dK/dV and dQ pairs, timing forward+backward)
      if timeout "${STEP_TIMEOUT:-0}" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py -k float32_fma \
        2>&1 | tee "$OUT/float32_test.log" | tail -5; [ "${PIPESTATUS[0]}" -eq 0 ]; then
        # FLOAT32_FMA_TILES' rows (head dim 64: GPT-2's; 128: Llama-3-8B's) against their neighbours and the table's
        (cd benchmarks && S="timeout ${STEP_TIMEOUT:-0} python3 sweep_tiles.py --float32" \
          && $S --cases gpt2:4096:causal --tiles 64,64,4,2 64,64,4,3 32,32,8,2 \
          && $S --cases llama3-8b:4096:causal --tiles 64,64,8,2 32,32,4,2 64,32,4,2 \
          && $S --kernel backward --cases gpt2:4096:causal --dkdv-tiles 64,32,4,2 64,64,4,3 --dq-tiles 64,64,4,2 64,64,4,3 \
          && $S --kernel backward --cases llama3-8b:4096:causal --dkdv-tiles 32,32,4,2 32,32,8,2 --dq-tiles 32,32,4,2 64,32,4,2) \
          2>&1 | tee "$OUT/float32_sweep.log" | grep -vi warn
      else
        echo "float32: the GPU check failed, so the sweep did not run"
      fi ;;
    bench_base)
      # python -m attnfuse.bench: the old tree's attnfuse.cli has no bench command; third-party plugins
      # (contrib/) may need the new API, so the old tree loads its built-ins only
      # run from inside .base: `python -m` puts the current directory first on sys.path, ahead of PYTHONPATH
      (cd .base && python3 -c "import attnfuse; print('kernels of', attnfuse.__file__)" \
        && ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${STEP_TIMEOUT:-0}" python3 -m attnfuse.bench ${BENCH_ARGS:-} \
        --markdown "$OUT/bench_base.md" --json "$OUT/bench_base.json") 2>&1 | tee "$OUT/bench_base.log" ;;
    hf_layer)
      timeout "${STEP_TIMEOUT:-0}" python3 benchmarks/hf_layer.py ${HF_ARGS:-} 2>&1 | tee "$OUT/hf_layer.log" ;;
    hf_generate)
      timeout "${STEP_TIMEOUT:-0}" python3 benchmarks/hf_generate.py ${HF_GEN_ARGS:-} 2>&1 | tee "$OUT/hf_generate.log" ;;
    profile)
      timeout "${STEP_TIMEOUT:-0}" python3 benchmarks/profile_training.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" ;;
    layer_steps)
      timeout "${STEP_TIMEOUT:-0}" python3 benchmarks/layer_steps.py ${LAYER_STEPS_ARGS:---timing 8192} 2>&1 \
        | tee "$OUT/layer_steps.log" ;;
    dmon)
      # the GPU's power, temperature and clocks once a second until the last step ends
      nvidia-smi dmon -s pc -d 1 -o T >"$OUT/dmon.log" 2>&1 </dev/null &
      dmon_pid=$! ;;
    validation)
      timeout "${STEP_TIMEOUT:-0}" python3 benchmarks/validation_cost.py 2>&1 | tee "$OUT/validation.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
