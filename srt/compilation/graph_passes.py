"""Graph passes: FX rewrites that Inductor runs on the graph it compiles, after
functionalisation and decomposition and before lowering (its `post_grad_custom_post_pass`).

A pass is registered by name where what it rewrites is defined (a layer op's fused-kernel
pattern next to the op), as a function that rewrites an aten-level `fx.Graph` in place and
returns how many places it changed:

    @register_graph_pass("rms_norm_kernel")
    def use_rms_norm_kernel(graph: fx.Graph) -> int:
        '''The decomposed RMSNorm reference replaced by `srt::rms_norm`.'''
        ...

`--compile-passes` picks which run (`resolve_passes`); they run in the order registered
passes are listed by `graph_passes()` (by name, unless a pass says it runs after others:
`after=`), in every Inductor compile of the traced graph: each piece in the piecewise mode,
the whole graph in the partition mode. A pass that must see the graph across the split ops
(`whole_graph=True`: it changes a tensor's shape between two of them) is refused in the
piecewise mode. Every run is logged with what it matched, and `applying` collects the counts
(per pass, per compile) for the runner's compile report.

Why Inductor's hook and not our own walk over the traced graph: after functionalisation the
graph has no in-place ops or views to respect, every decomposition Inductor would apply has
been applied (a pattern written as the reference is found as Inductor sees it), and what a
pass leaves is what gets lowered. Registration imports nothing of Inductor: a pass builds
what it needs (patterns, which trace with fake tensors) on its first run.

Most passes replace a pattern: `pattern_pass` makes one from a function that adds Inductor
pattern-matcher replacements (`add_replacement`: a search function, traced as Inductor's
graph shows it, in float32 and in a half dtype, and what replaces it):

    @register_graph_pass("rms_norm_kernel", op="rms_norm")
    @pattern_pass
    def use_rms_norm_kernel(patterns: PatternMatcherPass) -> None:
        '''The RMSNorm reference replaced by `srt::rms_norm`.'''
        add_replacement(patterns, rms_norm, rms_norm_kernel.op, example_inputs, {"eps": 1e-6})

A pass that puts a layer op's kernel in the graph names the op (`op=`, a `--custom-ops`
name): the runner refuses it where `--custom-ops` turns that kernel off.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import PatternMatcherPass

logger = logging.getLogger(__name__)

GraphPassFn = Callable[[fx.Graph], int]
# The passes that swap a layer op's reference for its kernel run after these, which change
# what the graph computes (sequence parallelism: each rank's share of the tokens); the kernel
# passes look for the reference in what they leave.
BEFORE_KERNEL_PASSES = ("sequence_parallel",)


@dataclass(frozen=True)
class GraphPass:
    name: str
    run: GraphPassFn
    doc: str  # the first line of the function's docstring
    whole_graph: bool = False  # needs the partition mode (it sees across the split ops)
    after: tuple[str, ...] = ()  # passes that run before this one when both are on
    op: str | None = None  # the layer op (`--custom-ops` name) whose kernel it puts in


_passes: dict[str, GraphPass] = {}


def register_graph_pass(
    name: str, *, whole_graph: bool = False, after: Sequence[str] = (), op: str | None = None
) -> Callable[[GraphPassFn], GraphPassFn]:
    """Register the decorated function as the graph pass `name` (see the module docstring)."""

    def decorator(fn: GraphPassFn) -> GraphPassFn:
        if name in _passes and _passes[name].run is not fn:
            raise ValueError(f"graph pass {name!r} is registered twice")
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        _passes[name] = GraphPass(name, fn, doc[0] if doc else "", whole_graph, tuple(after), op)
        return fn

    return decorator


def pattern_pass(add_patterns: Callable[[PatternMatcherPass], None]) -> GraphPassFn:
    """A graph pass that applies the replacements `add_patterns` adds to a pattern-matcher
    pass of its own (built on the first run: tracing the patterns needs Inductor); it returns
    how many it made. The pass keeps `add_patterns`' name, docstring and module."""

    @functools.cache
    def built() -> PatternMatcherPass:
        from torch._inductor.pattern_matcher import PatternMatcherPass

        patterns = PatternMatcherPass()
        add_patterns(patterns)
        return patterns

    @functools.wraps(add_patterns)
    def run(graph: fx.Graph) -> int:
        return built().apply(graph)

    return run


# The dtypes a pattern is traced in. The matcher ignores dtype (and size) constants at first,
# then traces the pattern again on each match's own inputs and compares exactly, so what
# differs between dtypes is only the graph's structure: float32 has no conversions (the
# references' `.float()` is a no-op there), every half dtype the same ones (float16 matches
# the bfloat16 pattern).
PATTERN_DTYPES = (torch.float32, torch.bfloat16)


def add_replacement(
    patterns: PatternMatcherPass,
    search: Callable[..., Any],
    replace: Callable[..., Any],
    example_inputs: Callable[[torch.dtype], list[torch.Tensor]],
    scalars: dict[str, float] | None = None,
) -> None:
    """Make `patterns` replace what `search` computes by what `replace` computes (the same
    arguments) in the graphs Inductor compiles, in each of PATTERN_DTYPES. `example_inputs(
    dtype)`: the tensor arguments to trace them with (CPU tensors; the device is not matched).
    `scalars`: the arguments that are numbers (eps), each given a value that no other constant
    of the pattern has, so that the matcher takes the graph's value for it (Inductor's
    `scalar_workaround`)."""
    from torch._inductor.pattern_matcher import register_replacement

    for dtype in PATTERN_DTYPES:
        register_replacement(
            search,
            replace,
            example_inputs(dtype),
            _trace_as_inductor_sees_it,
            patterns,
            scalar_workaround=scalars or {},
        )


def _trace_as_inductor_sees_it(fn: Callable[..., Any], args: Any, **kwargs: Any) -> fx.GraphModule:
    """Inductor's pattern trace (`fwd_only`, Inductor's decompositions) with every view made
    a reshape, as Inductor makes them in the graph it compiles before its passes run
    (compile_fx's `view_to_reshape`): a pattern traced with views would not match it."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm


def graph_passes() -> dict[str, GraphPass]:
    """Every registered pass, by name, in the order they run."""
    order: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in seen:
            raise ValueError(f"graph passes run after each other in a circle: {seen}")
        for before in _passes[name].after:
            if before in _passes:
                visit(before, (*seen, name))
        order.append(name)

    for name in sorted(_passes):
        visit(name, ())
    return {name: _passes[name] for name in order}


def resolve_passes(entries: Sequence[str] | None, default: Sequence[str] = ()) -> list[str]:
    """The passes `--compile-passes entries` turns on, in run order: `none`, `all`, or names
    (entries may be joined by commas); None gives `default`. ValueError (the message without
    the flag's name) for an unknown name or `none`/`all` with names."""
    known = graph_passes()
    if entries is None:
        chosen = set(default)
    else:
        items = [p.strip() for e in entries for p in e.split(",") if p.strip()]
        if not items:
            raise ValueError("expected 'none', 'all' or pass names, got nothing")
        if ("none" in items or "all" in items) and len(items) > 1:
            raise ValueError(f"'none' and 'all' stand alone, got {items}")
        chosen = set(known) if items == ["all"] else set() if items == ["none"] else set(items)
    unknown = sorted(chosen - set(known))
    if unknown:
        raise ValueError(
            f"unknown graph pass(es) {unknown}; the passes are {', '.join(known) or 'none'}"
        )
    return [name for name in known if name in chosen]


def passes_tag(names: Sequence[str]) -> str:
    """What the names of artifacts compiled with the passes `names` end with ("" for none):
    a compile with other passes is another artifact (the compile cache's code factor covers
    what the passes do)."""
    if not names:
        return ""
    return "-passes-" + hashlib.sha256(",".join(names).encode()).hexdigest()[:10]


def whole_graph_passes(names: Sequence[str]) -> list[str]:
    """Those of the passes `names` that need the partition mode."""
    known = graph_passes()
    return [name for name in names if known[name].whole_graph]


@dataclass
class PassLog:
    """What the passes matched: per pass, one count per Inductor compile it ran in."""

    matches: dict[str, list[int]] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        return {name: sum(counts) for name, counts in self.matches.items()}


def _passes_uuid(passes: Sequence[GraphPass]) -> str:
    """What Inductor's own caches key a compile with these passes by: the passes' names and
    the source of the modules that define them, and of this one (its pattern passes' trace
    is part of what they do)."""
    digest = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode())
    for p in passes:
        module = inspect.getmodule(p.run)
        source = inspect.getsource(module) if module is not None else p.run.__qualname__
        digest.update(f"{p.name}\0{source}\0".encode())
    return digest.hexdigest()


@contextmanager
def applying(names: Sequence[str]) -> Iterator[PassLog]:
    """Run the passes `names` in every Inductor compile inside (Inductor's config is patched
    for the duration); the log fills as they run. No names: Inductor's config is untouched."""
    log = PassLog({name: [] for name in names})
    if not names:
        yield log
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    known = graph_passes()
    passes = [known[name] for name in names]

    class RegisteredPasses(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in passes:
                matched = p.run(graph)
                log.matches[p.name].append(matched)
                logger.info("graph pass %s: %d match(es)", p.name, matched)
            graph.eliminate_dead_code()

        def uuid(self) -> str:
            return _passes_uuid(passes)

    with inductor_config.patch(post_grad_custom_post_pass=RegisteredPasses()):
        yield log
