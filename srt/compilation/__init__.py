"""Compilation layer: custom ops, split ops, tracing, piecewise compile, cache.

Nothing is imported here: a module of the layer is imported by name, so that what needs only
a light one (`compile_info`, `private_files`) does not pay for torch and Dynamo.

- `op_registry`: `register_custom_op`, `register_split_op`, `custom_ops()`, `split_ops()`,
  `inductor_trace()`.
- `piecewise_model`: `PiecewiseModel`, the forward traced once (or loaded), run with no guards.
- `compile_info`: `CompileInfo`, the server info's `compile` section, light to import.
- `backend`: the torch.compile backend Dynamo hands the traced graph to.
- `compiled_forward`: what the backend returns, saved with Dynamo's capture for a warm start.
- `bound_forward`: `BoundForward`, the split graph called without Dynamo (its inputs bound by
  name), saved where every piece loads without the compiler.
- `split`: the split at split ops and the piece signatures (identical pieces share).
- `piece_compiler`: a piece compiled once for the general shape, `eager`, `inductor` or
  `aot_inductor` (an AOTInductor package, loaded by torch's C++ loader).
- `dispatch`: per piece, per bucket states and the `Specializer` hook (CUDA graphs plug in).
- `cache`: the compile cache (`CompileCache`): an entry's directory, checked artifacts,
  Inductor's session and its file index.
- `cache_root`: the root, resolved once (`open_cache_root`): read-only roots, paths Inductor
  cannot build in, the tools' cache locations.
- `file_index`: `FileIndex`, what a tool built and the cache vouches for (no links).
- `precompiled_headers`: Inductor's shared C++ precompiled headers, built under a lock, checked.
- `cache_key`: the cache key (`CacheFactors`, `collect_factors`): environment, config, code,
  compiler.
- `bucket_manifest`: `BucketManifest`, the buckets an entry has seen, per phase.
- `private_files`: private directories and atomic writes (0700 / 0600), locks across processes.
- `errors`: `CompilationError` and what fails the trace-once contract.
- `triton_ahead`: `compile_ahead`, Triton kernels compiled side by side on a thread pool from
  a forward whose launches it turns into compiles (the warm-up's, before it runs).
- `triton_workers`: `CompileWorkers`, processes that compile those kernels into Triton's disk
  cache for the pool's threads (no torch at import: started before the runner imports it).

Design and how to read the logs: docs/compilation.md.
"""
