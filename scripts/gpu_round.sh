#!/usr/bin/env bash
# GPU rounds on a CUDA host without network access: the gpu tests and the benchmarks of
# docs/benchmarks.md, stage by stage, so that one call of a few minutes runs what belongs
# together. Results land in $OUT (default out/gpu-round), at most a handful of files per call:
#   round.log                       everything printed, and the tail of any failing step's log
#   environment.txt                 GPU, driver, Python, torch, CUDA, triton
#   runner-SHAPE.jsonl              srt.bench.one_batch (every decode path) + srt.bench.hf_baseline
#   cold_start-SHAPE.json / .png    srt.bench.cold_start on a random checkpoint written to disk
#   serving-SHAPE-VARIANT-INxOUT.json  srt.bench.serving per variant and lengths
#   noloss-SHAPE.json               srt.bench.serving, 2,000 requests at concurrency 128
#   attention.json                  srt.bench.attention (the attention op alone per backend)
# and the tables (scripts/bench_tables.py) are printed last.
#
# Usage: scripts/gpu_round.sh STAGE...   with STAGE one of
#   tests                pytest -m gpu (of TESTS_PATHS, default tests)
#   skinny               srt.bench.skinny_matmul --tune on both shapes: the kernel against
#                        cuBLAS per decode product and row bucket; the table it writes (under
#                        srt/layers/tuned/, used by the stages after it) comes back too
#   runner-SHAPE         one_batch for disabled, full, full-cublas (the skinny kernel off),
#                        full --enable-torch-compile, full with flashinfer attention
#                        (full-flashinfer, not in the default list), full with the
#                        skinny kernel's launch forced (full-pdl, full-plain: the
#                        default, auto, is pdl on sm_90; not in the default list either), full over
#                        Inductor pieces, breakable, tc_piecewise eager and inductor, full
#                        with prefill captured too; hf_baseline (floor, cuBLAS chain, HF);
#                        not in the default list: the partition mode under tc_piecewise
#                        (tc-partition) and full (full-partition); CONFIG@PASSES runs CONFIG
#                        with --compile-passes PASSES (full-partition@all,
#                        tc-inductor@rotary_kernel,silu_and_mul_kernel)
#                        (RUNNER_CONFIGS, RUNNER_SIZES and HF_METHODS override the lists, an
#                        empty HF_METHODS runs none;
#                        RUNNER_INPUT_LEN the prompt, default 128, into runner-SHAPE-ctxN;
#                        RUNNER_BASELINE configs run again from the tree in .baseline)
#   cold_start-SHAPE     the cold_start presets (COLD_START_CONFIGS overrides the list; with
#                        COLD_START_EXTRA="NAME=FLAGS" one more configuration; with
#                        COLD_START_BASELINE=1 the tree in .baseline's too, after), each
#                        on every backend of COLD_START_ATTENTION where it is set (e.g.
#                        "triton flashinfer": both backends' cold and warm starts, compared)
#   frontend             srt.bench.frontend: the main process alone at a FRONTEND_STEP_MS step
#                        (default 1.5), with each of FRONTEND_WORKERS tokenizer workers
#                        (default 1), and the same for the tree in .baseline if there is one
#   serving-SHAPE        serving at concurrency 1, 32, 64, 128 (64 requests at 1, 1,024 at the
#                        others; SERVING_CONCURRENCY overrides), each run against the runner
#                        ceiling one_batch measures first with the same flags, for 128 prompt
#                        tokens and 256 new, and 1,024 and 128 (SERVING_LENS="IN:OUT ..."):
#                        the defaults (full), overlap N steps deep (depthN: depth1, depth3),
#                        no overlap,
#                        nographs, prefill captured (prefill-full) or not (prefill-off), and
#                        captured with mixed steps (mixed), N tokenizer workers (twN), an
#                        output every N tokens (siN), polling N ms before sleeping (bpN),
#                        every bucket captured before ready (upfront), FlashInfer's
#                        attention (flashinfer);
#                        SERVING_VARIANTS overrides; SERVING_BENCH_FLAGS go to the bench
#                        (e.g. "--no-warmup" with SERVING_CONCURRENCY="1 128 1": concurrency
#                        1 on a fresh KV pool, then after 1,024 requests at 128)
#   noloss-SHAPE         2,000 requests at concurrency 128 (128 prompt tokens, 256 new) with
#                        the server's defaults and NOLOSS_FLAGS: all finish whole?
#   profile_start-SHAPE  scripts/profile_engine_start.py: first starts (empty cache) of the
#                        in-process engine, dummy weights, each under cProfile within one of
#                        PROFILE_WITHIN's ModelRunner methods (default _hand_out_compiles: the
#                        compile-ahead block's forwards), into profile_start-SHAPE-METHOD.txt;
#                        PROFILE_FLAGS: Engine fields (FIELD=VALUE ...); PROFILE_WARM=1: a warm
#                        start instead (one unprofiled start fills the cache first)
#   attention            srt.bench.attention on the 1B and 8B heads, for ATTENTION_BACKENDS
#                        (default: triton flashinfer)
# SHAPE is llama-3.2-1b or llama-3-8b. Carried wheels (.whl/*.whl) are installed first (again
# only when they changed), their commands (ninja, which FlashInfer's JIT runs) on the PATH.
# FlashInfer's modules build once per host under $WORK/flashinfer (FLASHINFER_WORKSPACE_BASE,
# unless set) for every stage but the cold starts, whose servers build under their own roots.
# PYCACHE=1: Python caches the bytecode of what it imports under $WORK/pycache (and first
# imports every module a start needs, so that no start pays for compiling them): the H200 host
# sets PYTHONDONTWRITEBYTECODE=1 and its site-packages hold no .pyc, so there every process
# compiles each module it imports from source (r24: `import torch` 4.5 s without a cache, 3.3
# with one; `import torch._inductor` 10.6 against 4.6), where an installed package normally
# has its bytecode from pip.
# Exit status: non-zero if any step failed (the others still run).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu-round}
work=${WORK:-/tmp/srt-gpu-round}  # traces, checkpoints, logs that need not come back
mkdir -p "$out" "$work/logs"
exec > >(tee -a "$out/round.log") 2>&1

export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  # pip gives every file it installs the time of the install, and FlashInfer's build files
  # list its headers (which are in the wheel) among each module's inputs: installing the same
  # wheels again would make ninja compile every module this host has built once more.
  wheels=$(sha256sum .whl/*.whl)
  if [ "$wheels" != "$(cat /tmp/site/.srt-wheels 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      .whl/*.whl && echo "$wheels" > /tmp/site/.srt-wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
# SITE_FIRST=DIR: packages installed there come before the carried wheels and the host's own
# (another transformers, say, to compare a start under each in one call).
[ -n "${SITE_FIRST:-}" ] && export PYTHONPATH=$SITE_FIRST:$PYTHONPATH
# Every dependency pyproject.toml declares, as this round would import it, at or above its
# floor: r35 carried wheels without transformers and ran the host's 5.17 (below the 5.23
# floor), whose tokenizer load (3.3-3.8 s against 1.0-1.3) then bounded every start it timed.
# BELOW_FLOOR_OK=1 runs anyway (a round that compares versions on purpose, with SITE_FIRST).
python3 - <<'PY' || [ "${BELOW_FLOOR_OK:-0}" = 1 ] || exit 1
import importlib.metadata as metadata
import sys
import tomllib

from packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    declared = tomllib.load(f)["project"]["dependencies"]
below = []
for line in declared:
    requirement = Requirement(line)
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        print(f"dependency check: {requirement.name} is not installed here")
        continue
    if not requirement.specifier.contains(version, prereleases=True):
        below.append(f"{requirement.name} {version} (srt needs {requirement.specifier})")
if below:
    sys.exit("dependency check: below pyproject.toml's floor: " + "; ".join(below)
             + " (carry its wheel in .whl/, docs/benchmarks.md)")
PY
if [ "${PYCACHE:-0}" = 1 ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=$work/pycache
  python3 - <<'PY'
import importlib, pkgutil
import srt
for module in ("torch", "torch._inductor.compile_fx", "torch._dynamo", "triton.compiler",
               "triton.backends.nvidia.compiler", "transformers", "tokenizers",
               "transformers.models.llama", "fastapi", "uvicorn", "zmq", "httpx"):
    importlib.import_module(module)
for info in pkgutil.walk_packages(srt.__path__, "srt."):
    try:
        importlib.import_module(info.name)
    except Exception as e:  # an optional package (FlashInfer) missing: its module is not used
        print(f"bytecode cache: {info.name} not imported ({type(e).__name__})")
PY
  echo "bytecode cache under $PYTHONPYCACHEPREFIX: $(du -sh "$PYTHONPYCACHEPREFIX" | cut -f1)"
fi
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$work/flashinfer}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__,
              'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in
              ('transformers', 'tokenizers', 'huggingface_hub')))"
  # The host's CPUs: its hyperthreads, cores and model say what the processes share.
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|CPU max MHz)'
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

status=0
step() {  # step NAME CMD...: run it, its output in $work/logs/NAME.log; on failure show the tail
  local name=$1; shift
  local start=$SECONDS
  if "$@" > "$work/logs/$name.log" 2>&1; then
    echo "ok     $name ($((SECONDS - start)) s)"
  else
    echo "FAILED $name ($((SECONDS - start)) s); the end of its log:"
    tail -n 25 "$work/logs/$name.log"
    status=1
  fi
}

runner() {  # the decode paths of srt and the alternatives on one shape
  local shape=$1 file="$out/runner-$1${RUNNER_INPUT_LEN:+-ctx$RUNNER_INPUT_LEN}.jsonl"
  local cache="$work/cache-$1"
  local sizes="1 8 32 128"
  [ "$shape" = llama-3.2-1b ] && sizes="1 8 16 32 64 128"  # beside serving's concurrencies
  sizes=${RUNNER_SIZES:-$sizes}
  local input_len=${RUNNER_INPUT_LEN:-128}
  local configs=${RUNNER_CONFIGS:-disabled full full-compile full-inductor breakable tc-eager tc-inductor prefill-full}
  local methods=${HF_METHODS-hf-eager hf-generate-static cublas-chain hf-compile-reduce-overhead}
  rm -f "$file"
  one() {  # one TREE NAME FLAGS...: one_batch of TREE's srt/ (., or .baseline: its own file)
    local tree=$1 name=$2 tag="" result=$file; shift 2
    [ "$tree" = .baseline ] && tag=-baseline result="$out/runner-$shape-baseline.jsonl"
    # shellcheck disable=SC2086
    step "one_batch-$shape-$name$tag" env -C "$tree" PYTHONPATH="/tmp/site:$(realpath "$tree")" \
      python3 -m srt.bench.one_batch --model-shape "$shape" \
      --dtype bfloat16 --batch-size $sizes --input-len "$input_len" --output-len 32 --runs 2 \
      --cuda-graph-backend-prefill disabled --compile-cache-dir "$cache$tag" \
      --profile "$work/profile-$shape$tag" --result-file "$(realpath "$result")" "$@"
  }
  declare -A flags=(
    [disabled]="--cuda-graph-backend-decode disabled"
    [full]="--cuda-graph-backend-decode full"
    [full-cublas]="--cuda-graph-backend-decode full --custom-ops all,-skinny_matmul"
    [full-compile]="--cuda-graph-backend-decode full --enable-torch-compile"
    [full-inductor]="--cuda-graph-backend-decode full --cuda-graph-tc-compiler inductor"
    [breakable]="--cuda-graph-backend-decode breakable"
    [tc-eager]="--cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler eager"
    [tc-inductor]="--cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler inductor"
    [full-aot]="--cuda-graph-backend-decode full --cuda-graph-tc-compiler aot_inductor"
    [tc-aot]="--cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler aot_inductor"
    [tc-partition]="--cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler inductor --inductor-graph-partition"
    [full-partition]="--cuda-graph-backend-decode full --cuda-graph-tc-compiler inductor --inductor-graph-partition"
    [prefill-full]="--cuda-graph-backend-decode full --cuda-graph-backend-prefill full"
    [full-flashinfer]="--cuda-graph-backend-decode full --attention-backend flashinfer"
    [full-pdl]="--cuda-graph-backend-decode full --skinny-matmul-launch pdl"
    [full-plain]="--cuda-graph-backend-decode full --skinny-matmul-launch plain"
  )
  local config method
  for config in $configs; do
    # CONFIG@PASSES: CONFIG with --compile-passes PASSES (all, or names joined by commas)
    local passes=()
    [[ $config == *@* ]] && passes=(--compile-passes "${config#*@}")
    # shellcheck disable=SC2086
    one . "$config" ${flags[${config%@*}]} "${passes[@]}"
  done
  # The same configs from the tree in .baseline (srt/ of an earlier commit): the change's
  # before and after in one call.
  if [ -d .baseline/srt ]; then
    for config in ${RUNNER_BASELINE:-}; do
      # shellcheck disable=SC2086
      one .baseline "$config" ${flags[$config]}
    done
  fi
  # transformers' compiled forward is measured at batch 1 only: each size is another compile.
  for method in $methods; do
    if [ "$method" = hf-compile-reduce-overhead ]; then
      step "$method-$shape" python3 -m srt.bench.hf_baseline --model-shape "$shape" \
        --batch-size 1 --methods "$method" --result-file "$file"
    else
      # shellcheck disable=SC2086
      step "$method-$shape" python3 -m srt.bench.hf_baseline --model-shape "$shape" \
        --batch-size $sizes --methods "$method" --result-file "$file"
    fi
  done
}

skinny() {  # the skinny matmul kernel against cuBLAS on both shapes' products; writes the table
  step skinny_matmul python3 -m srt.bench.skinny_matmul --model-shape llama-3.2-1b llama-3-8b \
    --tune --output "$out/skinny_matmul.json"
  tail -n 70 "$work/logs/skinny_matmul.log"
  cp srt/layers/tuned/skinny_matmul-*.json "$out/" 2>/dev/null
}

checkpoint() {  # sets CKPT: a random checkpoint of the shape on local disk, written once
  CKPT="$work/ckpt/$1"
  [ -f "$CKPT/model.safetensors.index.json" ] || \
    step "checkpoint-$1" python3 -m srt.tools.make_random_checkpoint "$work/ckpt" \
      --model-shape "$1"
}

shape_dir() {  # sets SHAPE_DIR: the shape's config and tokenizer, no weights (--load-format dummy)
  SHAPE_DIR="$work/shape/$1"
  [ -f "$SHAPE_DIR/config.json" ] || step "shape-$1" python3 -c \
    "import sys, pathlib; from srt.tools.model_shapes import write_model_shape
write_model_shape(sys.argv[1], pathlib.Path(sys.argv[2]))" "$1" "$work/shape"
}

cold_start() {
  local shape=$1
  local configs=${COLD_START_CONFIGS:-nographs full-lazy full-upfront tcpw-inductor-lazy tcpw-inductor-upfront full-inductor-lazy full-inductor-upfront}
  local backends=()
  # shellcheck disable=SC2206
  [ -n "${COLD_START_ATTENTION:-}" ] && backends=(--attention-backends $COLD_START_ATTENTION)
  checkpoint "$shape"
  rm -rf "$work/cold-$shape"
  # shellcheck disable=SC2086
  # COLD_START_EXTRA: one more configuration, NAME=FLAGS (e.g. the defaults with a flag changed)
  local extra=()
  [ -n "${COLD_START_EXTRA:-}" ] && extra=(--config "$COLD_START_EXTRA")
  step "cold_start-$shape" python3 -m srt.bench.cold_start --model-path "$CKPT" \
    --configs $configs "${extra[@]}" "${backends[@]}" --cache-root "$work/cold-$shape" \
    --output-file "$out/cold_start-$shape.json" --plot "$out/cold_start-$shape.png"
  # COLD_START_BASELINE=1: the same starts of the tree in .baseline (srt/ of an earlier
  # commit) after them, its modules' bytecode cached first where PYCACHE=1
  if [ "${COLD_START_BASELINE:-0}" = 1 ] && [ -d .baseline/srt ]; then
    local base="/tmp/site:$(realpath .baseline)"
    [ "${PYCACHE:-0}" = 1 ] && env -C .baseline PYTHONPATH="$base" python3 -c "
import importlib, pkgutil, srt
for info in pkgutil.walk_packages(srt.__path__, 'srt.'):
    try: importlib.import_module(info.name)
    except Exception: pass"
    rm -rf "$work/cold-$shape-baseline"
    # shellcheck disable=SC2086
    step "cold_start-$shape-baseline" env -C .baseline PYTHONPATH="$base" \
      python3 -m srt.bench.cold_start --model-path "$CKPT" --configs $configs \
      "${extra[@]}" "${backends[@]}" --cache-root "$work/cold-$shape-baseline" \
      --output-file "$(realpath "$out")/cold_start-$shape-baseline.json"
  fi
}

profile_start() {  # first starts of the engine, each profiled within one ModelRunner method
  local shape=$1 method
  shape_dir "$shape"
  local cache="$work/profile-cache-$shape" tag=${PROFILE_WARM:+-warm}
  for method in ${PROFILE_WITHIN:-_hand_out_compiles}; do
    local name="profile_start-$shape-${method#_}$tag"
    rm -rf "$cache"
    # PROFILE_WARM=1: a start that fills the cache first, unprofiled
    # shellcheck disable=SC2086
    [ -n "${PROFILE_WARM:-}" ] && step "$name-fill" python3 scripts/profile_engine_start.py \
      "$SHAPE_DIR" "$cache" - ${PROFILE_FLAGS:-}
    # shellcheck disable=SC2086
    step "$name" python3 scripts/profile_engine_start.py "$SHAPE_DIR" "$cache" \
      "$out/$name.txt" --within "$method" ${PROFILE_FLAGS:-}
    tail -n 2 "$work/logs/$name.log"
  done
}

noloss() {  # 2,000 requests at concurrency 128, 128 prompt tokens and 256 new: every one must
  # finish with its count, the KV come back, no capture or JIT compile inside the window
  local shape=$1 name="noloss-$1"
  shape_dir "$shape"
  # shellcheck disable=SC2086
  step "$name" python3 -m srt.bench.serving --max-concurrency 128 --num-prompts 2000 \
    --input-len 128 --output-len 256 --output-file "$out/$name.json" \
    --server-log "$work/logs/server-$name.log" -- --model-path "$SHAPE_DIR" \
    --load-format dummy ${NOLOSS_FLAGS:-}
  tail -n 3 "$work/logs/$name.log"
}

serving() {  # decode full with overlap (the default), and the variants that move it
  local shape=$1 variant lens
  shape_dir "$shape"  # random weights drawn on the device: a step's time does not need a file
  for lens in ${SERVING_LENS:-128:256 1024:128}; do
    local in_len=${lens%:*} out_len=${lens#*:}
    for variant in ${SERVING_VARIANTS:-full depth1 no-overlap nographs prefill-full mixed}; do
      local flags=(--cuda-graph-backend-decode full)
      # depthN: N steps ahead (the default is 2); depth1 one, depth3 more slack for the host
      [[ $variant == depth* ]] && flags+=(--overlap-depth "${variant#depth}")
      [ $variant = no-overlap ] && flags+=(--disable-overlap-schedule)
      [ $variant = nographs ] && flags=(--disable-cuda-graph)
      # Prefill captured per token bucket too; and decodes riding along in prefill steps.
      [ $variant = prefill-full ] && flags+=(--cuda-graph-backend-prefill full)
      [ $variant = prefill-off ] && flags+=(--cuda-graph-backend-prefill disabled)
      [ $variant = mixed ] && flags+=(--cuda-graph-backend-prefill full --enable-mixed-chunk)
      # twN: N tokenizer workers on the port; siN: outputs every N tokens
      [[ $variant == tw* ]] && flags+=(--tokenizer-worker-num "${variant#tw}")
      [[ $variant == si* ]] && flags+=(--stream-interval "${variant#si}")
      [[ $variant == bp* ]] && flags+=(--busy-poll-ms "${variant#bp}")  # bp0: sleep at once
      [ $variant = upfront ] && flags+=(--cuda-graph-capture upfront)  # every bucket before ready
      [ $variant = flashinfer ] && flags+=(--attention-backend flashinfer)
      local name="serving-$shape-$variant-${in_len}x${out_len}"
      # The bench's request counts (1,024 where more than 16 are in flight), its warm-up
      # bursts, and one_batch with the same flags for the ceiling before the server starts.
      step "$name" python3 -m srt.bench.serving \
        --max-concurrency ${SERVING_CONCURRENCY:-1 32 64 128} --input-len "$in_len" \
        --output-len "$out_len" --output-file "$out/$name.json" \
        --server-log "$work/logs/server-$name.log" ${SERVING_BENCH_FLAGS:-} \
        -- --model-path "$SHAPE_DIR" --load-format dummy "${flags[@]}"
      # A request that failed: what the server said about it.
      grep -n -i -B2 -A8 "error\|traceback" "$work/logs/server-$name.log" | tail -n 40
    done
  done
}

for stage in "$@"; do
  case $stage in
    tests)  # its whole log comes back: the failures are what the next round fixes
      # shellcheck disable=SC2086
      step tests timeout "${TESTS_TIMEOUT:-1200}" \
        python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${TESTS_PATHS:-tests}
      cp "$work/logs/tests.log" "$out/tests.log" ;;
    attention)
      # shellcheck disable=SC2086
      step attention python3 -m srt.bench.attention --backends ${ATTENTION_BACKENDS:-triton flashinfer} \
        --compile-cache-dir "$work/cache-attention" --output "$out/attention.json"
      sed -n '/^ *shape /,$p' "$work/logs/attention.log" ;;
    skinny) skinny ;;
    runner-*) runner "${stage#runner-}" ;;
    noloss-*) noloss "${stage#noloss-}" ;;
    cold_start-*) cold_start "${stage#cold_start-}" ;;
    profile_start-*) profile_start "${stage#profile_start-}" ;;
    serving-*) serving "${stage#serving-}" ;;
    frontend)  # the main process alone, against a stand-in scheduler at the runner's step;
      # with a baseline tree in .baseline (srt/ of an earlier commit), that one too
      for tree in . .baseline; do
        [ -d "$tree/srt" ] || continue
        workers=${FRONTEND_WORKERS:-1}; [ "$tree" = .baseline ] && workers=1
        for n in $workers; do
          name=frontend-tw$n; [ "$tree" = .baseline ] && name=frontend-baseline
          # The baseline predates --tokenizer-worker-num: one process there.
          extra=(); [ "$tree" = . ] && extra=(--tokenizer-worker-num "$n")
          step "$name" env -C "$tree" PYTHONPATH="/tmp/site:$(realpath "$tree")" \
            python3 -m srt.bench.frontend --step-ms "${FRONTEND_STEP_MS:-1.5}" "${extra[@]}" \
            --output-file "$(realpath "$out")/$name.json"
          tail -n 5 "$work/logs/$name.log"
        done
      done ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done

echo
for f in "$out"/runner-*.jsonl "$out"/cold_start-*.json "$out"/serving-*.json "$out"/noloss-*.json; do
  [ -f "$f" ] && python3 scripts/bench_tables.py "$f"
done
exit "$status"
