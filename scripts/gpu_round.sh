#!/usr/bin/env bash
# One GPU round for the graph backends, on a CUDA host without network access:
#   1. install the carried wheels (.whl/*.whl, from ../shared/gpu-host-wheels.sh) when present;
#   2. run every gpu-marked test (log: $OUT/pytest-gpu.log);
#   3. bench decode latency on a Llama-3.2-1B shape (random weights, bf16, batch 1) with decode
#      graphs disabled / full / breakable ($OUT/bench.jsonl, $OUT/bench-*.log);
#   4. print a short table last: decode ms/step per backend and the speedup over disabled.
# Usage, from anywhere: scripts/gpu_round.sh   (results under $OUT, default out/gpu-round)
# Exit status: pytest's (the bench failing also fails the round).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu-round}
mkdir -p "$out"

export PYTHONPATH=$PWD
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
for backend in disabled full breakable; do
  python3 -m srt.bench_one_batch --model-shape llama-3.2-1b --load-format dummy \
    --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 32 --runs 3 \
    --cuda-graph-backend-decode "$backend" --cuda-graph-backend-prefill disabled \
    --result-file "$out/bench.jsonl" > "$out/bench-$backend.log" 2>&1 \
    || { echo "bench with decode $backend failed: see $out/bench-$backend.log"; status=1; }
done

echo
tail -n 3 "$out/pytest-gpu.log"
python3 - "$out/bench.jsonl" <<'PY'
import json
import os
import sys

path = sys.argv[1]
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
base = {r["batch_size"]: r["decode_ms_per_step"] for r in rows if r["decode_backend"] == "disabled"}
print(f"\n{'model':<14}{'decode':<11}{'bs':>3}{'prefill ms':>12}{'decode ms/step':>16}"
      f"{'x disabled':>12}")
for r in rows:
    ms, ref = r["decode_ms_per_step"], base.get(r["batch_size"])
    speedup = f"{ref / ms:.2f}x" if ref and ms else "-"
    print(f"{r['model']:<14}{r['decode_backend']:<11}{r['batch_size']:>3}{r['prefill_ms']:>12.2f}"
          f"{ms:>16.3f}{speedup:>12}")
PY
exit "$status"
