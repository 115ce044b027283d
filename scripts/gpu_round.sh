#!/usr/bin/env bash
# One GPU round for the graph backends, on a CUDA host without network access:
#   1. install the carried wheels (.whl/*.whl, from ../shared/gpu-host-wheels.sh) when present;
#   2. run every gpu-marked test (log: $OUT/pytest-gpu.log);
#   3. bench decode latency on a Llama-3.2-1B shape (random weights, bf16, batch 1 and 8) with
#      decode graphs disabled / full / breakable / tc_piecewise (eager; inductor cold, then warm
#      from the same compile cache) ($OUT/bench.jsonl, $OUT/bench-*.log);
#   4. print a short table last: decode ms/step per backend and the speedup over disabled.
# Usage, from anywhere: scripts/gpu_round.sh   (results under $OUT, default out/gpu-round)
# Exit status: pytest's (the bench failing also fails the round).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu-round}
mkdir -p "$out"

export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__,
              'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$out/environment.txt"

python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tee "$out/pytest-gpu.log"
status=${PIPESTATUS[0]}

rm -f "$out/bench.jsonl"
cache=$(mktemp -d)  # one compile cache: the second inductor run is a warm start
bench() {  # bench NAME FLAGS...: one bench_one_batch run, its log in $out/bench-NAME.log
  local name=$1; shift
  python3 -m srt.bench_one_batch --model-shape llama-3.2-1b --load-format dummy \
    --dtype bfloat16 --batch-size 1 8 --input-len 128 --output-len 32 --runs 3 \
    --cuda-graph-backend-prefill disabled --compile-cache-dir "$cache" \
    --result-file "$out/bench.jsonl" "$@" > "$out/bench-$name.log" 2>&1 \
    || { echo "bench $name failed: see $out/bench-$name.log"; status=1; }
}
bench disabled --cuda-graph-backend-decode disabled
bench full --cuda-graph-backend-decode full
bench breakable --cuda-graph-backend-decode breakable
bench tc-eager --cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler eager
bench tc-inductor-cold --cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler inductor
bench tc-inductor-warm --cuda-graph-backend-decode tc_piecewise --cuda-graph-tc-compiler inductor

echo
tail -n 3 "$out/pytest-gpu.log"
python3 - "$out/bench.jsonl" <<'PY'
import json
import os
import sys

path = sys.argv[1]
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
base = {r["batch_size"]: r["decode_ms_per_step"] for r in rows if r["decode_backend"] == "disabled"}
print(f"\n{'decode':<24}{'bs':>3}{'startup s':>11}{'compile s':>11}{'hit':>6}{'prefill ms':>12}"
      f"{'decode ms/step':>16}{'x disabled':>12}")
for r in rows:
    name = r["decode_backend"] + (f"/{r['tc_compiler']}" if r.get("tc_compiler") else "")
    ms, ref = r["decode_ms_per_step"], base.get(r["batch_size"])
    speedup = f"{ref / ms:.2f}x" if ref and ms else "-"
    print(f"{name:<24}{r['batch_size']:>3}{r['startup_s']:>11.2f}{r['compile_s'] or 0:>11.2f}"
          f"{str(r['compile_cache_hit']):>6}{r['prefill_ms']:>12.2f}{ms:>16.3f}{speedup:>12}")
PY
exit "$status"
