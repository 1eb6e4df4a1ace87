"""fp32 linears on the faster of this CPU's two fp32 GEMMs: torch's BLAS (MKL) or oneDNN, picked by a measured race.

torch runs an fp32 `nn.Linear` and its backward on its BLAS, MKL in the CPU wheel. On AMD CPUs MKL takes its
generic path (`MKL_VERBOSE` names "Intel(R) Architecture processors"): on Zen 5 (AVX-512 at full width) it reaches
206-233 GFLOP/s on 2 cores where oneDNN's AVX-512 fp32 GEMM, which ships in the same wheel
(`torch.ops.mkldnn._linear_pointwise`), reaches 430-490 at the learner's shapes and 1.3-2.3x at 1-128 rows
(docs/kernels.md). Both are IEEE fp32 with fp32 accumulation; they differ only in summation order.

`use_fp32_gemm(model, choice)` resolves `choice` (`auto` races the two at the model's shape, `pick_kernel`) and, when
oneDNN won or was asked for, moves every plain `nn.Linear` of a module tree onto `OnednnLinear` (a class swap, as
`learner.aligned` does: parameters, state-dict keys and hooks are unchanged), whose forward and backward run their
three GEMMs on oneDNN. Anything else falls back to `nn.Linear.forward`: another dtype, device or tensor type,
autocast, an empty input.

- forward: y = x W^T + b as oneDNN's linear of (x, W);
- backward: dx = dy W as oneDNN's linear of (dy, W^T), dW = dy^T x as its linear of (dy^T, x^T), db = sum(dy). The
  weight operands W^T and x^T are strided views, which oneDNN reads in place (copying x^T made dW up to 1.5x slower
  at 256 output features); the input operand dy^T it copies to rows first, with torch's transposed copy (3-9 GB/s
  at the learner's shapes), so it gets `learner.native_ops.transpose`'s tiled copy instead (4-6x that rate with
  its AVX2 blocks, where the library is built; torch's copy where not).

oneDNN reorders the weight operand into its blocked layout inside every call: on the ~100M decode shape of `asyncrl
bench e2e` (5 micro-batches a step) the forward re-reads and rewrites each weight five times a step. Inside
`packed_weights(model, available_bytes)` (each minibatch of a learner's update after its first) the forward reorders
each weight once, at its first use, and reuses that copy until the block ends or the weight changes
(`torch.ops.mkldnn._reorder_linear_weight`: the same values in oneDNN's layout, summed in the same order, so the same
bits, tested; a one-row GEMM is never packed: oneDNN's matrix-vector kernel sums in another order). The backward's
input gradient does the same with W^T (the tiled `transpose`, then the reorder: again the same bits). The copies live
through the minibatch's forward and backward, twice as many bytes as the linear weights, so only while the machine's
available memory is at least `PACK_MIN_AVAILABLE_FACTOR` times that (`pack_allowed`); they are freed before the
optimizer step. Measured (Zen 4, 2026-12-05): the decode-shape step 15.20 -> 14.84 s (2 threads, medians of 4
alternated pairs; forward 5.0 -> 4.7 s); the SmolLM2-135M row on oneDNN, one thread, 13.38-13.86 -> 13.04-13.17 s,
its steady peak 4.2 -> 4.6-4.8 GB. Not in the first update: there the copies raised that row's first-step peak from
2.7 to 3.3 GB (`learner_peak_rss_gb_smol`, target 3) and their page faults made the step slower. W^T packed for the
backward (2026-12-05, eighth session; Zen 4, 2 threads, 2,064 rows): the input gradient's GEMMs 206-223 -> 222-227
GFLOP/s, 0.24 s a decode-shape step, for 0.08 s of packing (0.15 s with torch's transposed copy); the step 13.22 ->
13.14 s (means of 3 and 4 alternated steps, in the noise of single steps).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.config_schema import FP32_GEMMS  # `learner.fp32_gemm`'s choices
from learner.native_ops import transpose

RACE_ROWS = 256
"""Rows of the race's linear: a micro-batch's order of magnitude (the learner's run 256-4,000 tokens)."""
RACE_REPEATS = 2
"""Fewest timed rounds of the race (a round: one forward and backward of each kernel)."""
RACE_MIN_S = 0.05
"""Fewest seconds of timed rounds: a small shape runs many, so that its best round is an undisturbed one."""
WIN_MARGIN = 1.05
"""oneDNN is picked only when it is at least this much faster: a tie keeps torch's default."""
PACK_MIN_AVAILABLE_FACTOR = 8
"""`packed_weights` packs only while the machine's available memory is at least this many times the bytes of the
packed copies (`PACKED_COPIES` times the model's oneDNN linear weights): a learner short of memory keeps its peak."""
PACKED_COPIES = 2
"""Packed copies of each weight inside `packed_weights`: W (the forward's operand) and W^T (the input gradient's)."""

_packing: dict[tuple[int, bool], tuple[torch.Tensor, int, torch.Tensor]] | None = None
"""Inside `packed_weights`: (id(weight), transposed) -> (weight, its `_version` when packed, the packed copy); None
outside."""


@dataclass(frozen=True, slots=True)
class KernelPick:
    """The kernel an `auto` race chose (or the one asked for) and the GFLOP/s of a linear's forward and backward each
    reached (0: not raced)."""

    kernel: str
    blas_gflops: float = 0.0
    onednn_gflops: float = 0.0


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's fp32 linear on CPU."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and mkldnn is not None and hasattr(mkldnn, "_linear_pointwise"))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias on oneDNN; either operand may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def fp32_matmuls() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """a (M, K) @ b (K, N) on each fp32 GEMM this torch has, by kernel name: `blas` and, where available, `onednn`
    (what the benches' GEMM peaks are the best of)."""
    gemms: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"blas": torch.matmul}
    if onednn_available():
        gemms["onednn"] = lambda a, b: onednn_linear(a, b.t())
    return gemms


def _step_runner(linear: torch.nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], float]:
    """A call running the linear's forward and backward (input and weight gradient) on `x`; it returns its seconds."""

    def run() -> float:
        x.grad = linear.weight.grad = None
        started = time.perf_counter()
        linear(x).backward(grad_out)
        return time.perf_counter() - started

    return run


def race(in_features: int, out_features: int, rows: int = RACE_ROWS) -> KernelPick:
    """Time a linear's forward and backward through each module (`nn.Linear`, `OnednnLinear`: the autograd calls a
    learner step makes, so a small model's per-call overhead counts) on x (rows, in) with torch's current threads,
    alternating the two, at least `RACE_REPEATS` rounds and `RACE_MIN_S` seconds each; the faster of their best
    rounds, by `WIN_MARGIN`."""
    if not onednn_available():
        return KernelPick("blas")
    generator = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    onednn = copy.deepcopy(plain)
    onednn.__class__ = OnednnLinear
    x = torch.randn(rows, in_features, generator=generator, requires_grad=True)
    grad_out = torch.randn(rows, out_features, generator=generator)
    runners = [_step_runner(plain, x, grad_out), _step_runner(onednn, x, grad_out)]
    for run in runners:
        run()  # warm-up: oneDNN builds and caches its primitives for the shape
    best, spent, rounds = [float("inf")] * 2, 0.0, 0
    while rounds < RACE_REPEATS or spent < RACE_MIN_S:
        for k, run in enumerate(runners):
            seconds = run()
            best[k], spent = min(best[k], seconds), spent + seconds
        rounds += 1
    flops = 6.0 * rows * in_features * out_features
    blas_gflops, onednn_gflops = flops / best[0] / 1e9, flops / best[1] / 1e9
    return KernelPick("onednn" if onednn_gflops >= WIN_MARGIN * blas_gflops else "blas", blas_gflops, onednn_gflops)


def pick_kernel(choice: str, in_features: int, out_features: int) -> KernelPick:
    """`choice` of `FP32_GEMMS` resolved: `auto` races the two; `onednn` where this torch has none is an error."""
    if choice not in FP32_GEMMS:
        raise ValueError(f"fp32 GEMM {choice!r}: expected one of {', '.join(FP32_GEMMS)}")
    if choice == "onednn" and not onednn_available():
        raise RuntimeError("fp32 GEMM `onednn` asked for, but this torch build has no oneDNN linear on CPU "
                           "(torch.ops.mkldnn._linear_pointwise); use `blas` or `auto`")  # fmt: skip
    if choice == "auto":
        return race(in_features, out_features)
    return KernelPick(choice)


def _plain_cpu(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.dtype in dtypes and tensor.device.type == "cpu"


def plain_fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether our fp32 GEMM applies: every tensor a plain tensor or parameter (not a DTensor or another subclass) of
    fp32 on the CPU, and no CPU autocast (under which a linear computes in autocast's dtype: `learner.fp32_gemm`)."""
    return not torch.is_autocast_enabled("cpu") and all(_plain_cpu(t, (torch.float32,)) for t in tensors)


def fp32_kernel_takes(*tensors: torch.Tensor) -> bool:
    """Whether `fp32_kernel_inputs` gives these tensors (without upcasting them: the checks ahead of a kernel)."""
    dtypes = (torch.float32, torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else (torch.float32,)
    return all(_plain_cpu(t, dtypes) for t in tensors)


def fp32_kernel_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The inputs of one of our fp32 CPU kernels that stands in for ops autocast leaves alone or runs in its lower
    dtype (RMSNorm, SwiGLU, attention: `learner.fused_ops`): plain CPU tensors of fp32 as they are, and under CPU
    autocast (`precision.train` bf16 or fp16) those of its dtype upcast to fp32, so those ops compute in fp32 (at
    least autocast's precision) instead of falling back to HF's torch ops; None where any tensor is of another
    dtype, device or tensor type. The kernels' outputs are fp32, and the next linear casts them as autocast does."""
    return tuple(t.float() for t in tensors) if fp32_kernel_takes(*tensors) else None


def pack_allowed(model: torch.nn.Module, available_bytes: int | None) -> bool:
    """Whether `packed_weights` may hold two packed copies of `model`'s oneDNN linear weights (W for the forward, W^T
    for the backward): `available_bytes` (the machine's; None: unknown, no) at least `PACK_MIN_AVAILABLE_FACTOR`
    times their bytes."""
    if available_bytes is None:
        return False
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, OnednnLinear)}
    packed_bytes = PACKED_COPIES * sum(w.numel() * w.element_size() for w in weights.values())
    return packed_bytes > 0 and available_bytes >= PACK_MIN_AVAILABLE_FACTOR * packed_bytes


@contextmanager
def packed_weights(model: torch.nn.Module, available_bytes: int | None) -> Iterator[bool]:
    """Within the block, `OnednnLinear`'s forward packs each weight once (module docstring); the copies are freed on
    exit. Yields whether it packs (`pack_allowed`); blocks do not nest."""
    global _packing
    if _packing is not None:
        raise RuntimeError("packed_weights: already inside a packed_weights block")
    enabled = pack_allowed(model, available_bytes)
    _packing = {} if enabled else None
    try:
        yield enabled
    finally:
        _packing = None


def _packed_weight(weight: torch.Tensor, rows: int, transposed: bool = False) -> torch.Tensor:
    """The weight operand of a GEMM of `rows` rows: `weight` (the forward's) or its transpose (the backward's input
    gradient, dy W as the linear of (dy, W^T)); inside `packed_weights`, its packed copy (made now if there is none
    for the weight's current version), else the weight or a transposed view of it."""
    if _packing is None or rows < 2:  # one row: oneDNN's matrix-vector kernel, which sums in another order
        return weight.t() if transposed else weight
    key = (id(weight), transposed)
    entry = _packing.get(key)
    if entry is None or entry[0] is not weight or entry[1] != weight._version:
        entry = (weight, weight._version, reorder_weight(transpose(weight) if transposed else weight, rows))
        _packing[key] = entry
    return entry[2]


def reorder_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout for GEMMs of about `rows` rows (an opaque tensor `onednn_linear` takes as
    its weight; the same values)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


class _OnednnLinearFn(torch.autograd.Function):
    """A linear whose forward and backward GEMMs run on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
        flat = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(flat, weight)
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        return onednn_linear(flat, _packed_weight(weight, flat.shape[0]), bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        flat, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        if not grad.is_contiguous():  # an expanded gradient (stride 0): oneDNN wants a dense operand
            grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad, _packed_weight(weight, grad.shape[0], transposed=True)).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:  # dy^T is oneDNN's input operand, which it copies to rows itself: `transpose`
            grad_w = onednn_linear(transpose(grad), flat.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


class OnednnLinear(torch.nn.Linear):
    """`nn.Linear` whose fp32 CPU GEMMs, forward and backward, run on oneDNN (`use_fp32_gemm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > 0 and plain_fp32_cpu(x, self.weight):
            return _OnednnLinearFn.apply(x, self.weight, self.bias)
        return super().forward(x)


def race_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of the model's most frequent plain linear, the larger on a tie (a decoder projection, not
    a 49k-row LM head that would make the race take seconds); (1024, 1024) without one."""
    counts = Counter((m.in_features, m.out_features) for m in model.modules() if type(m) is torch.nn.Linear)
    return max(counts, key=lambda shape: (counts[shape], shape[0] * shape[1]), default=(1024, 1024))


def use_fp32_gemm(model: torch.nn.Module, choice: str) -> KernelPick:
    """Resolve `choice` (`auto` races at `race_shape(model)` on torch's current threads); with oneDNN, swap
    every plain `nn.Linear` of `model` to `OnednnLinear`. Returns the pick."""
    in_features, out_features = race_shape(model)
    pick = pick_kernel(choice, in_features, out_features)
    if pick.kernel == "onednn":
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = OnednnLinear
    return pick
