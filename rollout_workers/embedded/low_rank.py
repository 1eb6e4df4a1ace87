"""LoRA adapters in the embedded engine: `stack_low_rank` turns a fused group's adapters (q/k/v, gate/up, or one
linear) into one `LowRank`, and `add_low_rank` adds `s * B (A x)` into a base linear's fresh output
(`linears.low_rank_linear`: `y = Q(W) x + s * B (A x)` on any linear form).

The members' A matrices lie one above the other (one pass over x gives every member's `A x`) and each member's
`s * B` adds into its own output columns. On an AVX-512 CPU in fp32 both products run in one call of
csrc/lora_gemm.cpp: `lr_apply` on float32 adapters, `lr_apply_q8` on int8 ones with their per-rank scales
(converted in registers), or on an AMX CPU `lr_apply_q8_amx` on AMX-BF16 tiles (`int8_kernel`: A laid out for the
tiles once a version, `LowRank.amx`); elsewhere torch's GEMMs run them (int8 adapters on their float32 values).
Adapters the subscriber decoded into its pooled buffers (quant_sync/adapter_buffers.py) run in place, and what a
group of such a buffer needs beyond views is kept for the next version in it (`_STACKED`). The library also decodes
int8 adapter versions into float32 in one pass (`NativeDequantizer`) for engines that do not run them as int8.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quant_sync.adapter_buffers import is_plan_buffer, panels_of, pool_generation
from rollout_workers.embedded.native import NativeLibrary, chosen_kernel


@dataclass(slots=True)
class LowRank:
    """LoRA adapters in the engine's form: `s * B (A x)` = `s * (x A^T) b_t` with `b_t = B^T`. For a fused group the
    members' A are stacked (sum of ranks, in), so one GEMM gives every member's `A x`; each member's `b_t` then
    adds its own output columns in place, times its own `s`. A member without an adapter has none: its columns get
    exactly nothing."""

    a: torch.Tensor  # (R, in): the stacked A (`F.linear(x, a)`: peft's own first product, bit for bit)
    b_t: tuple[torch.Tensor, ...]  # per member with an adapter: B^T (r_i, out_i), contiguous where the kernel runs
    scalings: tuple[float, ...]  # per member with an adapter: its s (alpha / r)
    ranks: tuple[tuple[int, int], ...]  # per member: its columns of F.linear(x, a)
    cols: tuple[tuple[int, int], ...]  # per member: its output columns
    native: tuple[ctypes.Array, ...] | None = None  # lr_apply's member arrays (fp32, CPU): ranks, cols, panels, s
    panels: tuple[torch.Tensor, ...] = ()  # per member: b_t in lr_apply's panels of 32 columns (`panels_of`, _panels);
    # empty when rebuilt from `_STACKED` (the kernel arrays point into the pooled buffer that `a` keeps alive)
    a_scale: torch.Tensor | None = None  # int8 adapters (`a`, `b_t` int8, lr_apply_q8): A's per-rank scales (R,)
    b_scales: tuple[torch.Tensor, ...] = ()  # int8 adapters: each member's B per-rank scales (r_i,)
    amx: torch.Tensor | None = None  # int8 adapters on the `amx` kernel: A^T in the tiles' layout (int32 words,
    # lr_amx_pack_a; each B is laid out from its panels once a call)
    amx_jobs: ctypes.Array | None = None  # lr_amx_pack_all's job that makes `amx` from `a` (a view)


ENV_KERNEL = "ASYNCRL_LORA_KERNEL"
"""Forces the kernel of int8 adapters (one of KERNELS; it must run here)."""
KERNELS = ("amx", "avx512")
"""int8 adapters' kernels, best first: `amx` (csrc/lora_gemm.cpp `lr_apply_q8_amx`, AMX-BF16 tiles, the fp32 operand
in two bf16 pieces) and `avx512` (`lr_apply_q8`, fp32 FMAs)."""


def int8_kernel() -> str | None:
    """The kernel int8 adapters built now run on: `ASYNCRL_LORA_KERNEL` if set, else the best this CPU runs (`amx`
    where `lr_has_amx`); None where csrc/lora_gemm.cpp does not run (torch's GEMMs run them, on float32 values)."""
    lib = _native_lora()
    if lib is None:
        return None
    available = (["amx"] if lib.lr_has_amx() else []) + ["avx512"]
    return chosen_kernel(ENV_KERNEL, KERNELS, available, _LORA_LIBRARY)


def stack_low_rank(
    adapters: list[tuple | None],
    out_features: list[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> LowRank | None:
    """(A (r, in), B (out, r), scaling) per member of a fused group (None: no adapter), or int8 A and B with their
    per-rank scales (A, B, scaling, sA (r,), sB (r,)) -> one LowRank, or None.

    int8 adapters run as they are where csrc/lora_gemm.cpp does (`lr_apply_q8`: fp32 on an AVX-512F CPU, every member
    int8); elsewhere they run their float32 values (`_dequantized`). Adapters the subscriber decoded into its pooled
    buffers (`quant_sync.adapter_buffers.is_plan_buffer`) run as they are: a group's A are adjacent rows there (one
    view spans them), each B is a transposed view of a contiguous B^T and has its panels beside it (`panels_of`), so
    an adapter version builds without copying a value, and what the kernel needs beyond those views is kept for the
    next version in the same buffer (`_STACKED`). Any other tensors are copied (their owner may change them later).
    On the `amx` kernel (`int8_kernel`) the int8 A is also laid out for the tiles, once a version (`_amx_pack`)."""
    if len(adapters) != len(out_features):
        raise ValueError(f"stack_low_rank: {len(adapters)} adapters for {len(out_features)} output sizes")
    device = device or torch.device("cpu")
    native = device.type == "cpu" and dtype == torch.float32 and _native_lora() is not None
    held = [adapter for adapter in adapters if adapter is not None]
    int8 = bool(held) and native and all(len(adapter) == 5 for adapter in held)
    if not int8 and any(len(adapter) == 5 for adapter in held):  # int8 the kernel does not run: their fp32 values
        adapters = [_dequantized(*adapter) if adapter is not None and len(adapter) == 5 else adapter
                    for adapter in adapters]  # fmt: skip
        held = [adapter for adapter in adapters if adapter is not None]
    key = _pooled_key(adapters, out_features) if native else None
    built = _STACKED.get(key) if key is not None else None
    if built is not None:  # this group of this pooled buffer was stacked before: the same views, kernel arrays
        return _from_kept(built, held, int8)
    amx_kernel = int8 and int8_kernel() == "amx"
    matrix_dtype = torch.int8 if int8 else dtype
    a_parts, a_scales, bs, b_ts, b_scales, scalings, ranks, cols = [], [], [], [], [], [], [], []
    row = col = 0
    for adapter, out in zip(adapters, out_features):
        if adapter is not None:
            a, b, scaling = adapter[:3]
            _check_fits(a, b, out)
            if int8:
                _check_int8(*adapter)
                a_scales.append(adapter[3])
                b_scales.append(adapter[4].contiguous())
            a_parts.append(a)
            bs.append(b)
            b_ts.append(_as_engine_tensor(b.t(), matrix_dtype, device))  # B^T (r, out)
            scalings.append(float(scaling))
            ranks.append((row, row + a.shape[0]))
            cols.append((col, col + out))
            row += a.shape[0]
        col += out
    if not a_parts:
        return None
    a = _adjacent_rows(a_parts, matrix_dtype, device)
    if a is None:
        a = torch.cat([part.to(device=device, dtype=matrix_dtype) for part in a_parts]).contiguous()
    a_scale = None
    if int8:
        stacked_scale = _adjacent_rows([scale.view(-1, 1) for scale in a_scales], torch.float32, device)
        a_scale = stacked_scale.view(-1) if stacked_scale is not None else torch.cat(a_scales).contiguous()
    fields = {"a": a, "b_t": tuple(b_ts), "scalings": tuple(scalings), "ranks": tuple(ranks), "cols": tuple(cols),
              "a_scale": a_scale, "b_scales": tuple(b_scales)}  # fmt: skip
    if not native:
        return LowRank(**fields)
    panels = tuple(_decoded_panels(b, b_t) for b, b_t in zip(bs, b_ts))
    amx, amx_jobs = _amx_pack(a) if amx_kernel else (None, None)
    native_arrays = (
        (ctypes.c_int64 * (2 * len(ranks)))(*[bound for pair in ranks for bound in pair]),
        (ctypes.c_int64 * (2 * len(cols)))(*[bound for pair in cols for bound in pair]),
        (ctypes.c_void_p * len(panels))(*[panel.data_ptr() for panel in panels]),
        *([(ctypes.c_void_p * len(b_scales))(*[scale.data_ptr() for scale in b_scales])] if int8 else []),
        (ctypes.c_float * len(scalings))(*scalings),
    )
    storage = a.untyped_storage().data_ptr()
    pooled = [*panels, *b_scales, *([a_scale] if a_scale is not None else [])]
    if key is not None and all(t.untyped_storage().data_ptr() == storage for t in pooled):
        if len(_STACKED) >= STACKED_KEPT:
            _STACKED.clear()
        _STACKED[key] = _Stacked(
            a.shape[0], fields["scalings"], fields["ranks"], fields["cols"], native_arrays, amx, amx_jobs
        )
    return LowRank(**fields, native=native_arrays, panels=panels, amx=amx, amx_jobs=amx_jobs)


def pack_jobs(adapters: list[LowRank]) -> ctypes.Array | None:
    """The `amx` kernel's layout jobs of every adapter among `adapters` that has one, in one array (`repack`); None
    where none has. A pooled buffer's reused stacking keeps it (`ModelWeights.with_adapters`)."""
    jobs = [job for adapter in adapters if adapter.amx_jobs is not None for job in adapter.amx_jobs]
    return (ctypes.c_int64 * len(jobs))(*jobs) if jobs else None


def repack(jobs: ctypes.Array | None) -> None:
    """Run `pack_jobs`' jobs (one native call): the tile layouts again from the current values of views rewritten
    in place (a later version in the same pooled buffer); the layouts are copies, the rest of a LowRank views."""
    if jobs is not None and _LORA_LIBRARY.lib.lr_amx_pack_all(jobs, len(jobs) // 4) != 0:  # type: ignore[union-attr]
        raise RuntimeError("lora_gemm: lr_amx_pack_all refused (no AMX-BF16 on this CPU), yet it was chosen")


def _amx_pack(a: torch.Tensor) -> tuple[torch.Tensor, ctypes.Array]:
    """int8 A (R, in) laid out for `lr_apply_q8_amx` (A^T as int32 words), and the job that made it (`repack` makes
    it again from the same address)."""
    lib = _LORA_LIBRARY.lib
    packed = torch.empty(lib.lr_amx_a_words(a.shape[0], a.shape[1]), dtype=torch.int32)  # type: ignore[union-attr]
    job = (ctypes.c_int64 * 4)(a.data_ptr(), a.shape[0], a.shape[1], packed.data_ptr())
    repack(job)
    return packed, job


@dataclass(frozen=True, slots=True)
class _Stacked:
    """What `stack_low_rank` derived from a group of pooled-buffer adapters, holding no tensor (so the buffer is
    reused as soon as no version uses it; its next version then lies at the same addresses)."""

    rows: int
    scalings: tuple[float, ...]
    ranks: tuple[tuple[int, int], ...]
    cols: tuple[tuple[int, int], ...]
    native: tuple[ctypes.Array, ...]
    amx: torch.Tensor | None = None
    """The `amx` kernel's layout of the group's A (not a view of the buffer), repacked in place for each version."""
    amx_jobs: ctypes.Array | None = None
    """The jobs that make `amx` from the buffer's views (`repack`)."""


STACKED_KEPT = 4096
"""Groups `stack_low_rank` remembers (a version of the ~100M config has 32; the pool holds up to 4 versions)."""
_STACKED: dict[tuple, _Stacked] = {}
"""`_pooled_key` (its first item the `pool_generation` it is valid for) -> `_Stacked`."""


def _pooled_key(adapters: list[tuple | None], out_features: list[int]) -> tuple | None:
    """Where and how a group's adapters lie, where every A and B (float32, or int8 with scales) is a view of one
    pooled buffer (the subscriber's decoded versions); else None (those are copied, never remembered)."""
    key: list = [pool_generation(), tuple(out_features)]
    storage = None
    for adapter in adapters:
        if adapter is None:
            key.append(None)
            continue
        a, b, scaling = adapter[:3]
        scales = adapter[3:]  # int8 adapters: A's and B's scales
        if a.dtype != b.dtype or a.dtype != (torch.int8 if scales else torch.float32) or not is_plan_buffer(a):
            return None
        here = a.untyped_storage().data_ptr()
        if (storage is not None and here != storage) or b.untyped_storage().data_ptr() != here:
            return None
        storage = here
        key.append((a.data_ptr(), tuple(a.shape), a.stride(), b.data_ptr(), tuple(b.shape), b.stride(), float(scaling),
                    *(scale.data_ptr() for scale in scales)))  # fmt: skip
    return tuple(key) if storage is not None else None


def _from_kept(built: _Stacked, members: list[tuple], int8: bool) -> LowRank:
    """A group's LowRank from what was kept of its pooled buffer: views of this version's tensors, the kept arrays."""
    first = members[0][0]
    a = first.as_strided((built.rows, first.shape[1]), (first.shape[1], 1))
    a_scale = members[0][3].as_strided((built.rows,), (1,)) if int8 else None
    b_scales = tuple(member[4] for member in members) if int8 else ()
    repack(built.amx_jobs)  # this version's values into the kept layouts (the buffer's last version is not in use)
    return LowRank(a, tuple(member[1].t() for member in members), built.scalings, built.ranks, built.cols,
                   native=built.native, a_scale=a_scale, b_scales=b_scales, amx=built.amx,
                   amx_jobs=built.amx_jobs)  # fmt: skip


def _check_fits(a: torch.Tensor, b: torch.Tensor, out: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or b.shape[0] != out or b.shape[1] != a.shape[0]:
        raise ValueError(f"stack_low_rank: B {tuple(b.shape)} does not fit A {tuple(a.shape)} and {out} outputs")


def _check_int8(a: torch.Tensor, b: torch.Tensor, scaling: float, a_scale: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise ValueError(f"stack_low_rank: int8 adapters with scales, got A {a.dtype} and B {b.dtype}")
    rank = a.shape[0]
    if any(scale.shape != (rank,) or scale.dtype != torch.float32 for scale in (a_scale, b_scale)):
        raise ValueError(f"stack_low_rank: int8 adapters need float32 scales of shape ({rank},)")


def _dequantized(
    a: torch.Tensor, b: torch.Tensor, scaling: float, a_scale: torch.Tensor, b_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """An int8 adapter's float32 values: q * scale per rank component, bit for bit `round_adapter`'s."""
    return a.to(torch.float32) * a_scale[:, None], b.to(torch.float32) * b_scale[None, :], scaling


def _decoded_panels(b: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """B's panels as the subscriber decoded them beside it (`panels_of`), else made from `b_t` (B^T)."""
    panels = panels_of(b)
    return panels if panels is not None and panels.is_contiguous() else _panels(b_t)


def _panels(b_t: torch.Tensor) -> torch.Tensor:
    """B^T (rank, n) as csrc/lora_gemm.cpp streams it: (ceil(n / 32), rank, 32), panel t = columns 32t to 32t + 31
    (zeros past n), so the kernel reads each panel in order (one padded copy)."""
    rank, n = b_t.shape
    padded = F.pad(b_t, (0, -n % 32)) if n % 32 else b_t
    return padded.view(rank, -1, 32).transpose(0, 1).contiguous()


def _as_engine_tensor(value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`value` as the engine runs it: contiguous, in `dtype` on `device`; a decoded buffer's view as it is."""
    if value.dtype == dtype and value.device == device and value.is_contiguous() and is_plan_buffer(value):
        return value
    return torch.empty(value.shape, dtype=dtype, device=device).copy_(value)


def _adjacent_rows(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """One view over `parts` stacked row-wise, where they lie back to back in a decoded buffer; else None."""
    first = parts[0]
    if not is_plan_buffer(first) or first.dtype != dtype or first.device != device:
        return None
    pointer = first.data_ptr()
    for part in parts:
        if not part.is_contiguous() or part.dim() != 2 or part.shape[1] != first.shape[1] or part.data_ptr() != pointer:
            return None
        if part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        pointer += part.nbytes
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def _declare_lora(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    if lib.lr_abi_version() != 6:
        raise ValueError("lora_gemm library: unexpected ABI version")
    lib.lr_apply.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.lr_apply.restype = ctypes.c_int
    lib.lr_apply_q8.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, *[ptr] * 6, i64, ctypes.c_int]
    lib.lr_apply_q8.restype = ctypes.c_int
    lib.lr_apply_q8_amx.argtypes = lib.lr_apply_q8.argtypes
    lib.lr_apply_q8_amx.restype = ctypes.c_int
    lib.lr_has_amx.argtypes, lib.lr_has_amx.restype = [], ctypes.c_int
    lib.lr_amx_a_words.argtypes, lib.lr_amx_a_words.restype = [i64, i64], i64
    lib.lr_amx_pack_a.argtypes, lib.lr_amx_pack_a.restype = [ptr, i64, i64, ptr], ctypes.c_int
    lib.lr_amx_pack_all.argtypes, lib.lr_amx_pack_all.restype = [ptr, i64], ctypes.c_int
    lib.lr_dequantize_rows.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.lr_dequantize_rows.restype = None
    lib.lr_dequantize_panels.argtypes = [ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.lr_dequantize_panels.restype = None
    return lib


_LORA_LIBRARY = NativeLibrary("lora_gemm.cpp", _declare_lora)


class NativeDequantizer:
    """csrc/lora_gemm.cpp's one-pass int8 adapter decoding (`quant_sync.adapter_buffers.use_native`): each value
    float(q) * s, bit for bit torch's `q.float() * s`, straight into the float32 layouts. ctypes releases the GIL
    for the call, so the decode thread's Python runs meanwhile."""

    def __init__(self, lib: ctypes.CDLL, avx512: bool) -> None:
        self._lib, self.avx512 = lib, avx512

    def rows(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        """out (rows, cols) = q (rows, cols) * scale (rows,) per row; all contiguous, on the CPU."""
        self._lib.lr_dequantize_rows(q.data_ptr(), scale.data_ptr(), q.shape[0], q.shape[1], out.data_ptr(),
                                     int(self.avx512))  # fmt: skip

    def panels(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        """out (count, ceil(n / 32), r, 32): the panels of count B^T q (count, r, n) scaled per row by scale
        (count * r,), zero past n; all contiguous."""
        count, rank, n = q.shape
        self._lib.lr_dequantize_panels(q.data_ptr(), scale.data_ptr(), count, rank, n, out.data_ptr(),
                                       int(self.avx512))  # fmt: skip


def native_dequantizer() -> NativeDequantizer | None:
    """The decoder of int8 adapter versions where csrc/lora_gemm.cpp builds (any x86-64 CPU; its AVX-512 loops
    where `lr_has_avx512f` says so, which `ASYNCRL_ISA_CAP=avx2` turns off), else None."""
    lib = _LORA_LIBRARY.get()
    return None if lib is None else NativeDequantizer(lib, bool(lib.lr_has_avx512f()))


def _native_lora() -> ctypes.CDLL | None:
    """csrc/lora_gemm.cpp where it builds and the CPU has AVX-512F (else None: torch's GEMMs run the adapters)."""
    lib = _LORA_LIBRARY.get()
    return lib if lib is not None and lib.lr_has_avx512f() else None


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 scratch of at least `numel` values for lr_apply's `low` (x A^T), kept across calls."""
    held = getattr(_SCRATCH, "low", None)
    if held is None or held.numel() < numel:
        held = _SCRATCH.low = torch.empty(max(numel, 1 << 12), dtype=torch.float32)
    return held


def add_low_rank(x: torch.Tensor, out: torch.Tensor, adapter: LowRank) -> torch.Tensor:
    """`out + s * B (A x)`, added into `out` in place (a fresh linear output): every member's `A x` in one pass
    over x, then each member's product accumulated into its own output columns (no block-diagonal zeros, no extra
    pass over the output). fp32 on AVX-512: csrc/lora_gemm.cpp, one call on torch's threads (the bits of one; int8
    adapters packed for the `amx` kernel on AMX tiles); else torch's `F.linear` and `addmm_`.
    Measured on Zen 4 (hidden 1024, rank 16 on all 7 linears, 32 rows, one thread, under load), per decoder layer:
    542 us with a block-diagonal `addmm` per fused group, 356 us per member (torch), 220 us with the kernel,
    against 2.0 ms of INT8 base linears."""
    if not out.is_contiguous():
        out = out.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    if adapter.native is not None and rows.dtype == out.dtype == torch.float32 and rows.stride(-1) == 1:
        lib = _LORA_LIBRARY.lib  # loaded: `native` is only made where it is (its AVX-512F check in lr_apply itself)
        low = _scratch(rows.shape[0] * adapter.a.shape[0])  # (rows, R), written before it is read
        if adapter.a_scale is not None:  # int8 adapters
            ranks, cols, panels, b_scales, scalings = adapter.native
            apply, a = (lib.lr_apply_q8, adapter.a) if adapter.amx is None else (lib.lr_apply_q8_amx, adapter.amx)  # type: ignore[union-attr]
            threads = torch.get_num_threads()
            done = apply(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), a.data_ptr(),
                         adapter.a_scale.data_ptr(), adapter.a.shape[0], low.data_ptr(), len(adapter.b_t), ranks,
                         cols, panels, b_scales, scalings, out.data_ptr(), out.shape[-1], threads)  # fmt: skip
            if done != 0:
                kernel = "lr_apply_q8 (no AVX-512F" if adapter.amx is None else "lr_apply_q8_amx (no AMX-BF16"
                raise RuntimeError(f"lora_gemm: {kernel} on this CPU), yet adapters were packed for it")
            return out
        ranks, cols, b_ts, scalings = adapter.native
        done = lib.lr_apply(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), adapter.a.data_ptr(),  # type: ignore[union-attr]
                            adapter.a.shape[0], low.data_ptr(), len(adapter.b_t), ranks, cols, b_ts, scalings,
                            out.data_ptr(), out.shape[-1], torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise RuntimeError("lora_gemm: lr_apply refused (no AVX-512F on this CPU), yet its adapters were packed")
        return out
    if adapter.a_scale is not None:  # int8 adapters on torch's GEMMs: their float32 values
        a = adapter.a.to(torch.float32) * adapter.a_scale[:, None]
        b_ts = tuple(b_t.to(torch.float32) * scale[:, None] for b_t, scale in zip(adapter.b_t, adapter.b_scales))
        adapter = LowRank(a, b_ts, adapter.scalings, adapter.ranks, adapter.cols)
    low = F.linear(rows if rows.dtype == adapter.a.dtype else rows.to(adapter.a.dtype), adapter.a)
    if low.dtype != out.dtype:
        low = low.to(out.dtype)
    flat = out.view(-1, out.shape[-1])
    for (r0, r1), (c0, c1), b_t, scaling in zip(adapter.ranks, adapter.cols, adapter.b_t, adapter.scalings):
        target = flat if c1 - c0 == flat.shape[1] else flat[:, c0:c1]
        part = low if r1 - r0 == low.shape[1] else low[:, r0:r1]
        target.addmm_(part, b_t if b_t.dtype == out.dtype else b_t.to(out.dtype), alpha=scaling)
    return out
