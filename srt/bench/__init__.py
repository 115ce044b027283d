"""Benchmarks, each `python -m srt.bench.<name> --help`:

- `one_batch`: the model runner's prefill and decode latency per phase, bucket and backend,
  with an optional profile summary (kernels per step, GPU ms against wall ms);
- `serving`: load against the HTTP API (TTFT, TPOT, ITL per event and per token, end-to-end
  latency, throughput over the whole run and its steady part, each against the runner ceiling
  of `runner_ceiling`, from one_batch figures of the same call);
- `cold_start`: real servers per configuration, cold and warm compile cache: time to ready and
  its breakdown, first requests and first bucket hits against the steady state;
- `hf_baseline`: transformers on the same shape (eager, static cache, `torch.compile`), the
  bandwidth floor and the bare cuBLAS chain of a decode step;
- `attention`: the attention op alone per backend, decode and prefill (fresh and over a cached
  prefix) at serving's sizes, on a shape's heads, with each backend's first call apart.

Each prints a table last and writes JSON. Model sources: `--model-path DIR`, or `--model-shape`
(a published shape, `srt.tools.model_shapes`; `attention` takes only the shape's heads).
"""
