"""Find the first compiled piece (and the first op in it) whose output differs from eager.

    python -m srt.tools.compile_bisect --model-path DIR [--compilers aot_eager inductor]

The same inputs (one prefill of random prompts, or a decode step after it) go through:

1. the model's forward, eager (no Dynamo);
2. the traced forward split at the split ops, each piece as the FX graph Dynamo traced
   (`eager`): the reference of every piece, whose inputs and outputs are recorded;
3. each piece compiled for the general token count exactly as `tc_piecewise` serves it, with
   each compiler asked for (`aot_eager`: AOTAutograd's trace without code generation;
   `inductor`), run on the reference inputs of that piece, so an error does not spread.

For each compiler it reports the whole forward's difference from eager and the first piece
whose output is outside the tolerance; inside that piece, where it can, the first op whose
value differs: the piece's FX graph cut after op k, compiled alone for these inputs, against
the eager value of op k, bisected over k. A piece that differs under `aot_eager` too points at
the trace; one that differs under `inductor` alone, at its code generation.

`--partition` adds the partition mode (`--inductor-graph-partition`): the whole graph compiled
by Inductor once, its forward compared with eager's (its partitions take Inductor's buffers,
not the pieces' arguments, so the comparison is the whole forward's). `--compile-passes`
compiles Inductor's pieces (and the whole graph) with those graph passes, the op search too;
when a compile with passes differs, it is compiled again with none and with each pass alone,
and the report names the passes that change the result by themselves. The exit code is 1
when something differs, 0 when everything agrees.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map_only

from srt.batch_layout import ForwardMode
from srt.compilation.backend import MIN_TOKENS
from srt.compilation.cache import CompileCache
from srt.compilation.dispatch import BucketDispatcher, PieceFn
from srt.compilation.graph_passes import applying, resolve_passes
from srt.compilation.piece_compiler import aot_eager
from srt.compilation.piecewise_model import PiecewiseModel
from srt.compilation.split import SplitGraph
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan
from srt.layers.attention.layer import eager_forward_context
from srt.model_config import ModelConfig
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.runner_setup import compile_cache_factors
from srt.server_args import ServerArgs, ServerArgsError
from srt.tools.cli import keyword_options
from srt.tools.make_tiny_model import resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class Difference:
    """How far `actual` is from `expected`: `excess` > 1 means outside the tolerance."""

    max_abs: float
    excess: float

    @property
    def differs(self) -> bool:
        return not self.excess <= 1.0  # NaN differs


def compare(
    actual: Any, expected: Any, atol: float, rtol: float, skip: frozenset[int] = frozenset()
) -> Difference:
    """The largest difference over the tensors of two (nested) outputs, as `allclose` sees it,
    leaving out the leaves numbered in `skip`."""
    got, want = tree_leaves(actual), tree_leaves(expected)
    tensors = [
        (a, e)
        for i, (a, e) in enumerate(zip(got, want, strict=True))
        if isinstance(e, torch.Tensor) and i not in skip
    ]
    worst = Difference(0.0, 0.0)
    for a, e in tensors:
        if a.shape != e.shape:
            return Difference(float("inf"), float("inf"))
        a64, e64 = a.double(), e.double()
        abs_diff = (a64 - e64).abs()
        nan = a64.isnan() != e64.isnan()
        abs_diff = torch.where(a64.isnan() & e64.isnan(), 0.0, abs_diff)
        if nan.any():
            return Difference(float("nan"), float("nan"))
        if abs_diff.numel() == 0:
            continue
        excess = (abs_diff / (atol + rtol * e64.abs())).max().item()
        worst = Difference(max(worst.max_abs, abs_diff.max().item()), max(worst.excess, excess))
    return worst


def _clone(value: Any, keep: set[int]) -> Any:
    """`value` with every tensor copied, except those in `keep` (weights: by storage pointer)."""
    return tree_map_only(
        torch.Tensor, lambda t: t if t.untyped_storage().data_ptr() in keep else t.clone(), value
    )


@dataclass
class PieceRecord:
    args: tuple[Any, ...]
    output: Any


def record_pieces(
    pieces: Sequence[PieceFn], weights: set[int]
) -> tuple[list[PieceFn], list[PieceRecord]]:
    """Wrappers of `pieces` that record each call's arguments and output (one call each)."""
    records: list[PieceRecord] = []

    def wrap(fn: PieceFn) -> PieceFn:
        def run(*args: Any) -> Any:
            out = fn(*args)
            records.append(PieceRecord(_clone(args, weights), _clone(out, weights)))
            return out

        return run

    return [wrap(fn) for fn in pieces], records


# Buffers a piece allocates for the split op after it to fill: their contents are undefined.
_ALLOCATIONS = {torch.empty, torch.empty_like, "new_empty", torch.ops.aten.empty.memory_format}


def _allocates(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in _ALLOCATIONS


def unwritten_outputs(gm: fx.GraphModule) -> frozenset[int]:
    """The outputs of `gm` (as numbered leaves) that are fresh, unwritten buffers."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = tree_leaves(output.args[0])
    return frozenset(i for i, n in enumerate(leaves) if isinstance(n, fx.Node) and _allocates(n))


# ---- inside a piece: which op ------------------------------------------------------------


def node_values(gm: fx.GraphModule, args: Sequence[Any]) -> dict[str, Any]:
    """The eager value of every node of `gm` on `args`, by node name."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            values[n.name] = result
            return result

    Recorder(gm).run(*args)
    return values


def cut_after(
    gm: fx.GraphModule, last: fx.Node, keep: set[str]
) -> tuple[fx.GraphModule, list[str]]:
    """The part of `gm` up to the node `last`, returning what crosses the cut: `last` and
    every earlier node named in `keep` that a later node (or the output) still reads. Those
    are the values an error before the cut must show up in, so the search is monotone."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    crossing: list[fx.Node] = []
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        live = any(order[user] > order[last] for user in node.users)
        if node.name in keep and (node is last or live):
            crossing.append(node)
        if node is last:
            break
    graph.output(tuple(env[n] for n in crossing))
    graph.lint()
    return fx.GraphModule(gm, graph), [n.name for n in crossing]


def compile_for_inputs(compiler: str, gm: fx.GraphModule, args: Sequence[Any]) -> PieceFn:
    """`gm` compiled by `compiler` for these very inputs (static shapes: a search builds many
    small graphs, and the question is which op, not which shape)."""
    if compiler == "aot_eager":
        return aot_eager(gm, args)
    if compiler == "inductor":
        return torch._inductor.standalone_compile(
            gm, list(args), dynamic_shapes="from_example_inputs"
        )
    raise ValueError(f"unknown compiler {compiler!r}")


@dataclass
class OpReport:
    node: str
    target: str
    source: str  # the model's line that made it, where FX kept it
    difference: Difference
    compiled_graphs: int


def first_differing_op(
    compiler: str,
    gm: fx.GraphModule,
    args: Sequence[Any],
    atol: float,
    rtol: float,
) -> OpReport | None:
    """Bisect over the ops of `gm` for the first one whose compiled value differs: each step
    compiles `gm` cut after op k and compares what crosses the cut (`cut_after`)."""
    values = node_values(gm, args)
    ops = [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
        and not _allocates(n)
        and isinstance(values.get(n.name), torch.Tensor)
    ]
    names = {n.name for n in ops}
    compiled = 0
    checked: dict[int, Difference] = {}

    def check(i: int) -> Difference:
        nonlocal compiled
        if i not in checked:
            cut, crossing = cut_after(gm, ops[i], names)
            fn = compile_for_inputs(compiler, cut, args)
            compiled += 1
            checked[i] = compare(fn(*args), tuple(values[n] for n in crossing), atol, rtol)
        return checked[i]

    if not ops or not check(len(ops) - 1).differs:
        return None
    lo, hi = 0, len(ops) - 1  # ops[hi] differs; the first that does is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if check(mid).differs:
            hi = mid
        else:
            lo = mid + 1
    node = ops[hi]
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    source = " / ".join(line.strip() for line in trace[-2:]) if trace else ""
    return OpReport(node.name, str(node.target), source, checked[hi], compiled)


# ---- the whole run ------------------------------------------------------------------------


@dataclass
class CompilerReport:
    compiler: str
    forward: Difference  # the whole split graph on this compiler's pieces, against eager
    pieces: list[Difference] = field(default_factory=list)
    first_piece: int | None = None
    first_op: OpReport | None = None

    @property
    def differs(self) -> bool:
        return self.forward.differs or self.first_piece is not None


@dataclass
class PassEffect:
    """The whole forward compiled by Inductor in one mode with `passes`, against eager."""

    mode: str  # "piecewise" or "partition"
    passes: list[str]
    forward: Difference


@dataclass
class BisectReport:
    model: str
    phase: str
    num_tokens: int
    atol: float
    rtol: float
    num_pieces: int
    traced: Difference  # the split graph's eager pieces against the model's own forward
    compilers: list[CompilerReport]
    passes: list[str] = field(default_factory=list)  # Inductor's compiles ran these
    partition: Difference | None = None  # the partition mode's whole forward, when asked
    # When a compile with `passes` differs: that mode again with none, then each pass alone.
    pass_effects: list[PassEffect] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        partition = self.partition is not None and self.partition.differs
        return self.traced.differs or partition or any(c.differs for c in self.compilers)

    def changed_by(self, mode: str) -> list[str]:
        """The passes that alone make `mode`'s forward differ where it agrees without any."""
        effects = [e for e in self.pass_effects if e.mode == mode]
        if not effects or effects[0].forward.differs:  # effects[0]: no passes
            return []
        return [e.passes[0] for e in effects[1:] if e.forward.differs]


def make_plan(
    mode: ForwardMode, prompts: np.ndarray, prefix_len: int, first_slot: int
) -> BatchPlan:
    """A plan for request i (table row i + 1): `prompts[i]` at positions prefix_len..., its KV
    in consecutive slots from `first_slot + i * width`, width the prefix plus the prompt."""
    batch, length = prompts.shape
    width = prefix_len + length
    pos = np.tile(np.arange(prefix_len, width, dtype=np.int32), batch)
    rows = np.repeat(np.arange(1, batch + 1, dtype=np.int32), length)
    slots = (first_slot + (rows - 1) * width + pos).astype(np.int32)
    return BatchPlan.greedy(
        mode,
        input_ids=prompts.reshape(-1).astype(np.int32),
        positions=pos,
        out_cache_loc=slots,
        req_pool_indices=np.arange(1, batch + 1, dtype=np.int32),
        prefix_lens=np.full(batch, prefix_len, np.int32),
        extend_lens=np.full(batch, length, np.int32),
        table=(rows, pos, slots),
    )


def _piece_module(split: SplitGraph, piece: int) -> fx.GraphModule:
    """Piece `piece`'s FX graph as traced (the split graph's attribute is its router slot)."""
    gm = split.module._modules[split.pieces[piece]]
    assert isinstance(gm, fx.GraphModule), "split_module makes every piece a GraphModule"
    return gm


def _eager_forward(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    with torch.inference_mode(), eager_forward_context(batch, runner.attn_backend):
        return runner.model(batch.input_ids, batch.positions).clone()


def make_batch(
    runner: ModelRunner, phase: str, batch_size: int, prompt_len: int, seed: int
) -> ForwardBatch:
    """The batch to compare on: a prefill of random prompts, or a decode step after it."""
    rng = np.random.default_rng(seed)
    vocab = runner.config.vocab_size
    prompts = rng.integers(0, vocab, size=(batch_size, prompt_len))
    first_slot = 1  # after the dummy slot
    prefill = runner.make_forward_batch(make_plan(ForwardMode.EXTEND, prompts, 0, first_slot))
    if phase == "prefill":
        return prefill
    if phase != "decode":
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    # The prompts' KV first (eagerly; decode reads it), then one token each after them.
    _eager_forward(runner, prefill)
    step = rng.integers(0, vocab, size=(batch_size, 1))
    return runner.make_forward_batch(make_plan(ForwardMode.DECODE, step, prompt_len, first_slot))


def trace_pieces(
    runner: ModelRunner,
    compilers: Sequence[str],
    cache: CompileCache,
    batch: ForwardBatch,
    *,
    partition: bool = False,
    passes: Sequence[str] = (),
) -> PiecewiseModel:
    """`runner`'s model traced on `batch`, split, each piece compiled by each of `compilers`
    (`eager` first: the reference), Inductor's with `passes`; in the partition mode, the
    whole graph compiled by Inductor (`compilers` must be just that)."""
    piecewise = PiecewiseModel(
        runner.model,
        compilers=compilers,
        cache=cache,
        max_tokens=max(batch.num_tokens, MIN_TOKENS),
        partition=partition,
        passes=passes,
    )
    with eager_forward_context(batch, runner.attn_backend):
        piecewise.trace(batch.input_ids, batch.positions)
    return piecewise


def inductor_forward(
    runner: ModelRunner,
    cache: CompileCache,
    batch: ForwardBatch,
    *,
    partition: bool,
    passes: Sequence[str],
) -> torch.Tensor:
    """The forward on `batch` of `runner`'s model compiled by Inductor in one mode with
    `passes` (traced again: each variant is its own compile)."""
    piecewise = trace_pieces(runner, ["inductor"], cache, batch, partition=partition, passes=passes)
    with torch.inference_mode(), eager_forward_context(batch, runner.attn_backend):
        dispatcher = BucketDispatcher(piecewise.general("inductor"))
        return piecewise(batch.input_ids, batch.positions, dispatcher, None).clone()


@dataclass
class Reference:
    """What eager computed on the batch, for each compiler's pieces to be compared with."""

    forward: torch.Tensor  # the model's own forward, no Dynamo
    traced: Difference  # the split graph on its eager pieces, against `forward`
    pieces: list[PieceRecord]  # each eager piece's inputs and output
    weights: set[int]  # storage pointers of the weights (passed, never copied)
    unwritten: list[frozenset[int]]  # per piece, the outputs that are unwritten buffers


@dataclass
class Bisection:
    """One comparison: the runner, its model's pieces traced on `batch`, the tolerance."""

    runner: ModelRunner
    piecewise: PiecewiseModel
    batch: ForwardBatch
    atol: float
    rtol: float
    passes: Sequence[str] = ()  # Inductor's compiles run them (the op search's too)

    @property
    def split(self) -> SplitGraph:
        split = self.piecewise.backend.split
        assert split is not None, "the pieces are traced before the bisection"
        return split

    def _split_forward(self, pieces: list[PieceFn]) -> torch.Tensor:
        batch = self.batch
        with eager_forward_context(batch, self.runner.attn_backend):
            dispatcher = BucketDispatcher(pieces)
            return self.piecewise(batch.input_ids, batch.positions, dispatcher, None).clone()

    def reference(self) -> Reference:
        """Run the eager forward, then the split graph on its eager pieces, recording them."""
        split = self.split
        unwritten = [unwritten_outputs(_piece_module(split, i)) for i in range(len(split.pieces))]
        expected = _eager_forward(self.runner, self.batch)
        weights = {t.untyped_storage().data_ptr() for t in self.runner.model.state_dict().values()}
        recording, records = record_pieces(self.piecewise.general("eager"), weights)
        with torch.inference_mode():
            traced = compare(self._split_forward(recording), expected, self.atol, self.rtol)
        return Reference(expected, traced, records, weights, unwritten)

    def compare_compiler(self, compiler: str, reference: Reference) -> CompilerReport:
        """The whole forward on `compiler`'s pieces, then each piece on its reference inputs
        (so that an error does not spread), against the reference."""
        general = self.piecewise.general(compiler)
        with torch.inference_mode():
            forward = compare(self._split_forward(general), reference.forward, self.atol, self.rtol)
            report = CompilerReport(compiler, forward)
            for i, (fn, rec) in enumerate(zip(general, reference.pieces, strict=True)):
                out = fn(*_clone(rec.args, reference.weights))
                diff = compare(out, rec.output, self.atol, self.rtol, reference.unwritten[i])
                report.pieces.append(diff)
                if diff.differs and report.first_piece is None:
                    report.first_piece = i
        return report

    def search_op(self, report: CompilerReport, reference: Reference) -> None:
        """Set `report.first_op`: the first op of its first differing piece that differs."""
        if report.first_piece is None:
            return
        args = reference.pieces[report.first_piece].args
        gm = _piece_module(self.split, report.first_piece)
        passes = self.passes if report.compiler == "inductor" else ()
        with torch.inference_mode(), applying(passes):
            report.first_op = first_differing_op(report.compiler, gm, args, self.atol, self.rtol)

    def pass_effects(self, mode: str, reference: Reference) -> list[PassEffect]:
        """`mode`'s whole forward compiled with no passes, then with each pass alone."""
        effects = []
        for passes in [[], *([p] for p in self.passes)]:
            cache = self.piecewise.cache
            out = inductor_forward(
                self.runner, cache, self.batch, partition=mode == "partition", passes=passes
            )
            diff = compare(out, reference.forward, self.atol, self.rtol)
            effects.append(PassEffect(mode, passes, diff))
        return effects


def bisect(
    runner: ModelRunner,
    compilers: Sequence[str],
    cache: CompileCache,
    *,
    phase: str = "prefill",
    batch_size: int = 2,
    prompt_len: int = 8,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    search_ops: bool = True,
    partition: bool = False,
    passes: Sequence[str] = (),
    piece_hook: Callable[[PiecewiseModel], None] | None = None,
) -> BisectReport:
    """Run the comparison on `runner`'s model (its graphs disabled: this traces its own);
    `partition` adds the partition mode's whole forward, `passes` run in Inductor's compiles.
    `piece_hook` sees the compiled model before anything runs (tests use it to break a piece)."""
    if (partition or passes) and "inductor" not in compilers:
        raise ValueError("the partition mode and graph passes are Inductor's: add inductor")
    tol = DEFAULT_TOLERANCE.get(runner.config.dtype, 1e-3)
    atol, rtol = atol if atol is not None else tol, rtol if rtol is not None else tol
    batch = make_batch(runner, phase, batch_size, prompt_len, seed)
    piecewise = trace_pieces(runner, ["eager", *compilers], cache, batch, passes=passes)
    if piece_hook is not None:
        piece_hook(piecewise)
    bisection = Bisection(runner, piecewise, batch, atol, rtol, passes)
    reference = bisection.reference()
    reports = [bisection.compare_compiler(compiler, reference) for compiler in compilers]
    if search_ops:
        for report in reports:
            bisection.search_op(report, reference)
    result = BisectReport(
        model=str(runner.config.path),
        phase=phase,
        num_tokens=batch.num_tokens,
        atol=atol,
        rtol=rtol,
        num_pieces=len(bisection.split.pieces),
        traced=reference.traced,
        compilers=reports,
        passes=list(passes),
    )
    if partition:
        whole = inductor_forward(runner, cache, batch, partition=True, passes=passes)
        result.partition = compare(whole, reference.forward, atol, rtol)
    if passes:
        inductor = next(c for c in reports if c.compiler == "inductor")
        differing = {
            "piecewise": inductor.differs,
            "partition": result.partition is not None and result.partition.differs,
        }
        for mode in (mode for mode, differs in differing.items() if differs):
            result.pass_effects += bisection.pass_effects(mode, reference)
    return result


def format_report(report: BisectReport) -> str:
    passes = f"; Inductor with graph passes {', '.join(report.passes)}" if report.passes else ""
    lines = [
        f"{report.model}: {report.phase}, {report.num_tokens} tokens, {report.num_pieces} "
        f"pieces, tolerance atol {report.atol:g} rtol {report.rtol:g}{passes}",
        f"traced split graph (eager pieces) vs the eager forward: max abs "
        f"{report.traced.max_abs:.3g}{'  DIFFERS' if report.traced.differs else ''}",
    ]
    for c in report.compilers:
        lines.append(
            f"{c.compiler}: whole forward max abs {c.forward.max_abs:.3g}"
            f"{'  DIFFERS' if c.forward.differs else ''}"
        )
        if c.first_piece is None:
            lines.append(f"  every piece agrees (worst max abs {_worst(c.pieces):.3g})")
            continue
        d = c.pieces[c.first_piece]
        lines.append(
            f"  first differing piece: {c.first_piece} (max abs {d.max_abs:.3g}, "
            f"{d.excess:.3g}x the tolerance)"
        )
        if c.first_op is not None:
            op = c.first_op
            lines.append(
                f"  first differing op in it: {op.node} = {op.target} (max abs "
                f"{op.difference.max_abs:.3g}; {op.compiled_graphs} graphs compiled)"
            )
            if op.source:
                lines.append(f"    from: {op.source}")
    if report.partition is not None:
        lines.append(
            f"inductor, partition mode: whole forward max abs {report.partition.max_abs:.3g}"
            f"{'  DIFFERS' if report.partition.differs else ''}"
        )
    for mode in dict.fromkeys(e.mode for e in report.pass_effects):
        lines.append(f"graph passes, {mode} mode, whole forward compiled with:")
        for e in (e for e in report.pass_effects if e.mode == mode):
            lines.append(
                f"  {', '.join(e.passes) or 'no passes'}: max abs {e.forward.max_abs:.3g}"
                f"{'  DIFFERS' if e.forward.differs else ''}"
            )
        culprits = report.changed_by(mode)
        lines.append(
            f"  changed by: {', '.join(culprits)}"
            if culprits
            else "  no pass alone changes it (without passes it differs too, or only together)"
        )
    verdict = "something differs" if report.differs else "everything agrees"
    lines.append(f"result: {verdict}")
    return "\n".join(lines)


def _worst(diffs: Sequence[Difference]) -> float:
    return max((d.max_abs for d in diffs), default=0.0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m srt.tools.compile_bisect",
        description="Find the first compiled piece, and op, whose output differs from eager.",
    )
    parser.add_argument("--model-path", default=None, help="default: the built-in tiny model")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument(
        "--compilers",
        nargs="+",
        default=["aot_eager", "inductor"],
        choices=["aot_eager", "inductor"],
    )
    parser.add_argument("--phase", default="prefill", choices=["prefill", "decode"])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=None, help="default: by dtype")
    parser.add_argument("--rtol", type=float, default=None, help="default: by dtype")
    parser.add_argument("--no-op-search", action="store_true", help="stop at the piece")
    parser.add_argument(
        "--partition",
        action="store_true",
        help="also compare the partition mode (--inductor-graph-partition); needs inductor",
    )
    parser.add_argument(
        "--compile-passes",
        nargs="+",
        default=None,
        help="graph passes for Inductor's compiles: all or names (default: none); when a "
        "result differs, each pass alone is tried",
    )
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="default: a fresh temporary one, so every piece is compiled now; give a cache "
        "root to check the artifacts it holds",
    )
    parser.add_argument("--result-file", default=None, help="write the report as JSON")
    return parser


def _make_runner(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelRunner:
    """A model runner with its graphs disabled and room for the batch the options ask for."""
    args = ServerArgs(
        model_path=ns.model_path,
        device=ns.device,
        dtype=ns.dtype,
        load_format=ns.load_format,
        seed=ns.seed,
        disable_cuda_graph=True,
        max_total_tokens=ns.batch_size * (ns.prompt_len + 1) + 1,
    )
    args.model_path = resolve_model_path(args.model_path)
    try:
        args.check()
    except ServerArgsError as e:
        parser.error(str(e))
    config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
    return ModelRunner(args, config)


def _cache(root: Path, runner: ModelRunner) -> CompileCache:
    """The runner's compile cache entry, kept apart from the server's (this tool compiles
    with its own compilers)."""
    factors = compile_cache_factors(
        runner.args,
        runner.config,
        Path(inspect.getfile(type(runner.model))),
        runner.device,
        runner.attention_backend_name,
        runner.graph_configs,
        runner.custom_ops,
        runner.tp,
        inductor="inductor",
    )
    return CompileCache(root, replace(factors, config={**factors.config, "tool": "compile_bisect"}))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.batch_size < 1 or ns.prompt_len < 1:
        parser.error("--batch-size and --prompt-len must be at least 1")
    if (ns.partition or ns.compile_passes) and "inductor" not in ns.compilers:
        parser.error("--partition and --compile-passes need inductor among --compilers")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    runner = _make_runner(ns, parser)  # imports the model, whose modules register the passes
    try:
        passes = resolve_passes(ns.compile_passes)
    except ValueError as e:
        parser.error(f"--compile-passes: {e}")
    with tempfile.TemporaryDirectory(prefix="srt-bisect-") as tmp:
        cache = _cache(Path(ns.compile_cache_dir or tmp), runner)
        options = keyword_options(ns, bisect)
        report = bisect(
            runner,
            ns.compilers,
            cache,
            search_ops=not ns.no_op_search,
            passes=passes,
            **options,
        )
    if ns.result_file:
        Path(ns.result_file).write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(format_report(report))
    return 1 if report.differs else 0


if __name__ == "__main__":
    sys.exit(main())
