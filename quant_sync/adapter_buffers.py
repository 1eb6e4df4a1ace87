"""Int8 adapter versions decoded straight into reused float32 buffers (the worker's side of `pack_adapters`).

A LoRA run publishes an adapter version every train step, each with the same packed index (names, shapes, offsets);
only the bytes change. `PackedPlan` reads that index once (`plan_for` caches it): `pack_adapters` places the int8
matrices of one part and shape back to back (by layer, then q, k, v, o, gate, up, down), their float32 scales too,
and B as the bytes of B^T, so each such group dequantizes with ONE `torch.mul` from the received buffer into a
float32 buffer of the plan: A as (count, r, in), B transposed as (count, r, out) (B^T), and B^T once more in panels
of 32 columns (count, ceil(out / 32), r, 32), the layout the engine's low-rank kernel streams (csrc/lora_gemm.cpp;
`panels_of`). Every
matrix is a view of it: A a (r, in) view, B a transposed (out, r) view. The values are the generic decoder's bit for
bit (the same float32 multiply `q * scale`, elementwise).

The float32 buffers are reused across versions: a plan keeps up to BUFFER_SETS of them and writes a version into one
whose storage nothing else references any more (every view of it dropped: the engine no longer runs that version,
nothing staged or queued holds it); when all are held, a fresh one is allocated. So a version costs no fresh
allocation (14 MB of page faults on the ~100M config) and no copy after this one: the engine
(rollout_workers/embedded/low_rank.py, `stack_low_rank`) runs views of these buffers as they are (`is_plan_buffer`,
`panels_of`): a fused group's A are adjacent rows, each B^T has its panels. Any other tensor it copies, since its
owner may write it later.

An engine that runs int8 adapters as published takes each version as a `PooledAdapters` (`decode_pooled`): the int8
buffer's views are made once per buffer, not once per version, and the buffer stays busy while that object lives;
what the engine derives from the views (its stacked adapters) is made once per buffer too (`PooledAdapters.derived`).
A version of the ~100M config then costs its copy and no per-tensor work: 0.46 against 1.38 ms of one thread's CPU
from the received bytes to the engine running it (read, decode, stage and swap; one Zen 5 core, family 26).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

T = TypeVar("T")

BUFFER_SETS = 4
"""float32 buffers a plan keeps: the version the engine runs, one staged, one queued at the subscriber, the one
being decoded."""
PLANS_KEPT = 2
"""Packed layouts whose plans (and buffers) are kept (a run publishes one)."""
_PLANS: OrderedDict[tuple[bytes, int], PackedPlan | None] = OrderedDict()
_PLANS_LOCK = threading.Lock()
PANEL = 32
"""Columns of B^T per panel (csrc/lora_gemm.cpp's tile width)."""
_POOLED: dict[int, weakref.ref[torch.Tensor]] = {}
"""The data pointer of every pooled buffer's storage -> the buffer, weakly (`is_plan_buffer`; a dead one stays
until a new buffer takes its address)."""
_PANELS: dict[int, dict[int, tuple[int, int, int]]] = {}
"""The data pointer of a pooled buffer's storage -> {index of a B^T: (index of its panels, rank, out)}, in the
buffer's elements (float32 values, or bytes of an int8 buffer)."""
_GENERATION = [0]
"""Counts pooled buffers made (`pool_generation`)."""


def pool_generation() -> int:
    """Changes whenever a new pooled buffer is made (and only then): while it stays the same, an address in a pooled
    buffer names the same place of the same plan's layout, so a holder may key what it derived from one by it."""
    return _GENERATION[0]


@dataclass(frozen=True, slots=True)
class Entry:
    """One packed tensor as the plan needs it: `role` "A" or "B" (an adapter matrix), "A_scale" / "B_scale" (the
    scales of `matrix`), or "" (any other tensor, e.g. a `.lora_scaling`)."""

    name: str
    role: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the packed buffer
    matrix: str = ""  # a scale's matrix
    transposed: bool = False  # the bytes hold the matrix's transpose (row-major)


@dataclass(frozen=True, slots=True)
class _Group:
    transposed: bool  # B: written as B^T
    source_transposed: bool  # B: its bytes hold B^T (pack_adapters): no strided read
    count: int
    rank: int
    other: int  # A: in features; B: out features
    q_start: int  # byte offset of the first int8 matrix
    s_start: int  # float32 index of the first scale
    out_start: int  # float32 index in a buffer
    panel_start: int = 0  # B: float32 index of the first member's panels in a buffer

    @property
    def panels(self) -> int:
        return -(-self.other // PANEL)


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors reference `tensor`'s storage (None where this torch cannot say)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return None if counter is None else int(counter(tensor.untyped_storage()._cdata))


def is_plan_buffer(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of a plan's pooled buffer: written only by its plan, and only once no tensor
    references it any more, so a holder may run it without a copy."""
    return tensor.device.type == "cpu" and _pooled(tensor.untyped_storage().data_ptr()) is not None


def _pooled(pointer: int) -> torch.Tensor | None:
    held = _POOLED.get(pointer)
    return None if held is None else held()


def _pool_id(buffer: torch.Tensor) -> int | None:
    """`buffer`'s storage pointer where a plan's pool keeps it (its templates are keyed so), else None."""
    pointer = buffer.untyped_storage().data_ptr()
    return pointer if _pooled(pointer) is buffer else None


def panels_of(b: torch.Tensor) -> torch.Tensor | None:
    """The panels (ceil(out / 32), r, 32) of a decoded B (out, r) (its B^T in panels of 32 columns, zero-padded: the
    layout csrc/lora_gemm.cpp streams), a view of the same pooled buffer; None for any other tensor."""
    if b.device.type != "cpu" or b.dim() != 2:
        return None
    pointer = b.untyped_storage().data_ptr()
    buffer = _pooled(pointer)
    if buffer is None:
        return None
    where = _PANELS.get(pointer, {}).get((b.data_ptr() - buffer.data_ptr()) // buffer.element_size())
    if where is None or b.dtype != buffer.dtype or b.shape != (where[2], where[1]) or b.stride() != (1, where[2]):
        return None
    start, rank, out = where
    count = -(-out // PANEL)
    return buffer[start : start + count * rank * PANEL].view(count, rank, PANEL)


@dataclass(frozen=True, slots=True, eq=False)
class PooledAdapters:
    """An int8 adapter version written into a pooled buffer (`PackedPlan.decode_pooled`). Its buffer is written
    again only once this object is gone: keep it as long as anything uses `tensors`."""

    plan: PackedPlan
    buffer_id: int | None
    """The buffer's storage pointer where the plan's pool keeps it, else None: the same `buffer_id` means the same
    `tensors` objects (and what was `derived` from them), rewritten in place by each version written there."""
    tensors: dict[str, torch.Tensor]
    """The version's tensors as `decode_int8` gives them (views of the buffer); shared by every version written into
    the same pooled buffer: read it, never change it."""
    lease: torch.Tensor
    """An empty view of the buffer: a user of its storage, so the pool does not hand the buffer out again."""
    others: tuple[float, ...] = ()
    """The values of the version's float32 tensors other than matrices and scales (each adapter's scaling)."""

    def derived(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()`, made once per pooled buffer and `key` (which must name all `make` reads beyond the buffer's
        layout, e.g. `others`): what a holder derives from `tensors` (views included) for every later version in
        the same buffer. The views it holds count among the buffer's idle users. A buffer beyond the pool's:
        `make()` each time."""
        if self.buffer_id is None:
            return make()
        return self.plan.derived(self.buffer_id, key, make)


class Dequantizer(Protocol):
    """One-pass int8 decoding into the plan's layouts (the engine's csrc/lora_gemm.cpp: `use_native`)."""

    def rows(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None: ...

    def panels(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None: ...


_NATIVE: dict[str, Any] = {"provider": None}
"""`provider`: what `use_native` was given; `dequantizer`: its answer, once asked."""


def use_native(provider: Callable[[], Dequantizer | None] | None) -> None:
    """Decode through `provider()`'s dequantizer, asked once, at the first packed version (None: torch's two passes).
    The rollout worker's engine sets it: the library lives with the engine's kernels, beside this module's users."""
    _NATIVE.clear()
    _NATIVE["provider"] = provider


def _dequantizer() -> Dequantizer | None:
    if "dequantizer" not in _NATIVE:
        provider = _NATIVE["provider"]
        _NATIVE["dequantizer"] = None if provider is None else provider()
    return _NATIVE["dequantizer"]


def _aligned(offset: int) -> int:
    """`offset` rounded up to 64 bytes (where each part of a pooled int8 buffer starts)."""
    return -(-offset // 64) * 64


def _fill(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> None:
    """out = q * scale (`_dequantize_into`), or q as it is without a scale."""
    if scale is None:
        out.copy_(q)
    else:
        _dequantize_into(out, q, scale)


def _dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """out = q * scale (int8 q, float32 out and scale, broadcast), in two float passes: the same values as
    `torch.mul(q, scale, out=out)`, whose mixed-dtype path is 3.9x slower (0.33 against 1.28 ms per million)."""
    out.copy_(q)
    out.mul_(scale)


class PackedPlan:
    """How every version with one packed index decodes (see the module docstring)."""

    def __init__(
        self,
        groups: list[_Group],
        outputs: list[tuple[str, int, int, tuple[int, ...]]],
        numel: int,
        scale_names: dict[str, str] | None = None,
        packed_nbytes: int | None = None,
    ):
        self.groups = groups
        self.outputs = outputs  # (name, group, member, _): a matrix; (name, -1, float32 index, shape): a view as is
        self.numel = numel
        self.scale_names = scale_names or {}  # matrix name -> its scales' name (kept by `decode(keep_int8=True)`)
        self._buffers: list[tuple[torch.Tensor, int | None]] = []
        self._buffers_int8: list[tuple[torch.Tensor, int | None]] = []
        self._derived: dict[int, dict[Hashable, Any]] = {}
        """An int8 buffer's storage pointer -> what holders derived from its views (`PooledAdapters.derived`)."""
        self._int8_templates: dict[int, dict[str, torch.Tensor]] = {}
        """An int8 buffer's storage pointer -> its views (`_int8_views`), made once when the pool took the buffer in
        (`decode_pooled` hands them out): they count among the buffer's idle users."""
        self._int8_panel_copies: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per pooled int8 buffer of a verbatim plan: the (panels, B^T) view pairs its B panels are copied through
        (`_verbatim_panel_copies`), made once with the buffer (`_take`) and counted among its idle users: a version
        then costs one copy per pair and makes no view."""
        self._lock = threading.Lock()
        self.packed_nbytes = packed_nbytes
        self.verbatim = packed_nbytes is not None and all(g.source_transposed or not g.transposed for g in groups)
        """An int8 buffer holds the packed bytes as received (each B as the bytes of B^T), B's panels after them: a
        version is one copy of its bytes, verifiable where it lands (`decode_pooled`'s `check`)."""
        self._others = [(name, start, math.prod(shape), shape) for name, group, start, shape in outputs if group < 0]
        self._others_index = torch.cat(  # float32 indices of the other tensors in a packed buffer, in that order
            [torch.arange(start, start + numel) for _, start, numel, _ in self._others] or [torch.zeros(0)]
        ).long()
        self.int8_layout, offset = [], _aligned(packed_nbytes) if self.verbatim else 0  # type: ignore[arg-type]
        for group in groups:  # per group: byte offsets of its int8 matrices, their float32 scales, its int8 panels
            size = group.count * group.rank * group.other
            if self.verbatim:
                q_at, scales_at, panels_at = group.q_start, 4 * group.s_start, offset
            else:
                q_at = offset
                scales_at = _aligned(offset + size)
                offset = panels_at = scales_at + 4 * group.count * group.rank
            self.int8_layout.append((q_at, scales_at, panels_at))
            offset = _aligned(panels_at + (group.count * group.panels * group.rank * PANEL if group.transposed else 0))
        self._others_at = None if self.verbatim else offset
        """Where the other float32 tensors lie in an int8 buffer: copied together here, else at their packed place."""
        self.int8_nbytes = _aligned(offset + (0 if self.verbatim else 4 * len(self._others_index)))
        starts = {torch.float32: [(g.out_start, g.panel_start) for g in groups],
                  torch.int8: [(q_at, panels_at) for q_at, _, panels_at in self.int8_layout]}  # fmt: skip
        self._panel_index = {  # per buffer dtype: a B^T's start -> (its panels' start, rank, out), in elements
            dtype: {
                matrix_at + j * g.rank * g.other: (panels_at + j * g.panels * g.rank * PANEL, g.rank, g.other)
                for g, (matrix_at, panels_at) in zip(groups, at) if g.transposed for j in range(g.count)
            }
            for dtype, at in starts.items()
        }  # fmt: skip

    @classmethod
    def build(cls, entries: list[Entry], packed_nbytes: int | None = None) -> PackedPlan | None:
        """The plan of this index, or None where it does not fit one (matrices not int8, a group not back to back,
        scales missing or misshapen): the generic decoder then handles it (and names what is wrong)."""
        scale_entries = [entry for entry in entries if entry.role in ("A_scale", "B_scale")]
        scales = {entry.matrix: entry for entry in scale_entries}
        matrices = [entry for entry in entries if entry.role in ("A", "B")]
        if len(scales) != len(scale_entries) or set(scales) != {entry.name for entry in matrices}:
            return None
        members: dict[tuple[str, tuple[int, ...], bool], list[tuple[Entry, Entry]]] = {}
        for entry in matrices:
            scale = scales[entry.name]
            if entry.dtype != torch.int8 or len(entry.shape) != 2 or scale.dtype != torch.float32:
                return None
            rank = entry.shape[0] if entry.role == "A" else entry.shape[1]
            if scale.shape != (rank,) or scale.role != entry.role + "_scale" or rank < 1:
                return None
            if entry.transposed and entry.role != "B":
                return None
            members.setdefault((entry.role, entry.shape, entry.transposed), []).append((entry, scale))
        groups, where, out_start = [], {}, 0
        for (role, shape, source_transposed), pairs in members.items():
            pairs.sort(key=lambda pair: pair[0].start)
            rank, other = (shape[0], shape[1]) if role == "A" else (shape[1], shape[0])
            (first_matrix, first_scale) = pairs[0]
            for j, (matrix, scale) in enumerate(pairs):
                if (
                    matrix.start != first_matrix.start + j * rank * other
                    or scale.start != first_scale.start + j * 4 * rank
                ):
                    return None  # not back to back in one order: no single multiply
                where[matrix.name] = (len(groups), j)
            q_start, s_start = first_matrix.start, first_scale.start // 4
            group = _Group(role == "B", source_transposed, len(pairs), rank, other, q_start, s_start, out_start)
            out_start += len(pairs) * rank * other
            if group.transposed:
                group = dataclasses.replace(group, panel_start=out_start)
                out_start += len(pairs) * group.panels * rank * PANEL
            groups.append(group)
        outputs = []
        for entry in entries:
            if entry.role in ("A", "B"):
                outputs.append((entry.name, *where[entry.name], ()))
            elif not entry.role:
                if entry.dtype != torch.float32:
                    return None
                outputs.append((entry.name, -1, entry.start // 4, entry.shape))
        return cls(groups, outputs, out_start, {entry.matrix: entry.name for entry in scale_entries}, packed_nbytes)

    def decode(self, packed: torch.Tensor, keep_int8: bool = False) -> dict[str, torch.Tensor]:
        """The version's tensors (in index order, scales dropped): matrices as float32 views of a pooled buffer,
        other float32 tensors as views of `packed` (the received buffer, int8, as `pack_adapters` made it).
        `keep_int8`: the matrices stay int8 with their scales (`decode_int8`)."""
        if keep_int8:
            return self.decode_int8(packed)
        flat = packed.reshape(-1)
        whole = flat.view(torch.float32)
        native = _dequantizer() if flat.is_contiguous() and flat.device.type == "cpu" else None
        with self._lock:  # two threads must not pick the same free buffer
            buffer = self._take(self._buffers, self.numel, torch.float32)
            views = []
            for group in self.groups:
                size = group.count * group.rank * group.other
                q = flat[group.q_start : group.q_start + size]
                scale = whole[group.s_start : group.s_start + group.count * group.rank].view(group.count, group.rank, 1)
                out = buffer[group.out_start : group.out_start + size].view(group.count, group.rank, group.other)
                if native is not None and (group.source_transposed or not group.transposed):
                    rows = group.count * group.rank
                    native.rows(q.view(rows, group.other), scale.view(rows), out.view(rows, group.other))
                    views.append(out.transpose(1, 2).unbind(0) if group.transposed else out.unbind(0))
                    if group.transposed:
                        panels = buffer[group.panel_start : group.panel_start + group.count * group.panels
                                        * group.rank * PANEL]  # fmt: skip
                        native.panels(q.view(group.count, group.rank, group.other), scale.view(rows), panels)
                    continue
                if group.transposed:  # B^T (count, r, out): B^T[j, n] = B[n, j] = q[n, j] * scale[j]
                    source = q.view(group.count, group.rank, group.other)  # pack_adapters: B^T's bytes
                    if not group.source_transposed:  # another packer's B (count, out, r): a strided read
                        source = q.view(group.count, group.other, group.rank).transpose(1, 2)
                    _dequantize_into(out, source, scale)
                    views.append(out.transpose(1, 2).unbind(0))
                    self._write_panels(buffer, group.panel_start, group, source, scale)
                else:  # A (count, r, in); A[j, k] = q[j, k] * scale[j]
                    _dequantize_into(out, q.view(group.count, group.rank, group.other), scale)
                    views.append(out.unbind(0))
        return {
            name: views[group][member] if group >= 0 else whole[member : member + math.prod(shape)].view(shape)
            for name, group, member, shape in self.outputs
        }

    def decode_int8(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The version's tensors as published (int8 matrices and their float32 scales), copied into a pooled int8
        buffer: A as (r, in) views, B as transposed (out, r) views of B^T, each B^T also in int8 panels of 32
        columns beside it (`panels_of`), for an engine that runs int8 adapters (csrc/lora_gemm.cpp `lr_apply_q8`):
        a 2.3 MB copy per version of the ~100M config, where decoding writes 14 MB of float32. The other float32
        tensors (each adapter's scaling) are copied into the buffer too. Fresh views: the buffer stays busy while
        any of them lives."""
        flat = packed.reshape(-1)
        with self._lock:
            buffer = self._take(self._buffers_int8, self.int8_nbytes, torch.int8)
            self._write_int8(buffer, flat)
        return self._int8_views(buffer)

    def decode_pooled(
        self, packed: torch.Tensor | np.ndarray, check: Callable[[torch.Tensor], None] | None = None
    ) -> PooledAdapters:
        """`decode_int8` without a view made per version: the tensors are views the buffer's pool made once, the
        same objects for every version written into that buffer, and the buffer stays busy while the returned
        `PooledAdapters` lives (its `lease`), not while its tensors do. For a holder that keeps the version whole
        (the embedded engine: staged, then running): a version of the ~100M config has 280 tensors, and each train
        step publishes one.

        `packed` may be read-only bytes (numpy) of a verbatim plan (`verbatim`), e.g. a version in the publisher's
        /dev/shm ring: `check(copy)` then gets the bytes as copied (int8) and raises to refuse them (a digest that
        does not match), before anything else is written; the buffer stays free."""
        flat = packed.reshape(-1)
        with self._lock:
            buffer = self._take(self._buffers_int8, self.int8_nbytes, torch.int8)
            self._write_int8(buffer, flat, check)
            lease = buffer[:0]  # a fresh view: one more user of the buffer's storage while the version is held
        pointer = _pool_id(buffer)
        others = tuple(self._others_in(buffer).tolist())
        if pointer is None:  # a buffer beyond the pool's: its own fresh views, held by the lease's owner
            return PooledAdapters(self, None, self._int8_views(buffer), lease, others)
        return PooledAdapters(self, pointer, self._int8_templates[pointer], lease, others)

    def _others_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """The values of the version's other tensors in an int8 buffer (`_write_int8`), in index order."""
        if self._others_at is None:
            return buffer.view(torch.float32)[self._others_index]
        return buffer[self._others_at : self._others_at + 4 * len(self._others_index)].view(torch.float32)

    def derived(self, buffer_id: int, key: Hashable, make: Callable[[], T]) -> T:
        """`PooledAdapters.derived` for the pooled int8 buffer `buffer_id`. Its holder leases it (nothing else makes
        or drops views of it meanwhile), so the change in its users across `make()` is what `make()` keeps."""
        with self._lock:
            kept = self._derived.setdefault(buffer_id, {})
            if key in kept:
                return kept[key]
            at = next(at for at, (buffer, _) in enumerate(self._buffers_int8)
                      if buffer.untyped_storage().data_ptr() == buffer_id)  # fmt: skip
            buffer, idle = self._buffers_int8[at]
            before = _storage_users(buffer)
            kept[key] = made = make()
            if idle is not None and before is not None:
                self._buffers_int8[at] = (buffer, idle + _storage_users(buffer) - before)  # type: ignore[operator]
            return made

    def _write_int8(
        self, buffer: torch.Tensor, flat: torch.Tensor | np.ndarray, check: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """A packed version's bytes into an int8 buffer (`int8_layout`): matrices, scales, B's panels, others."""
        if self.verbatim:  # the bytes as they came, then B's panels from the B^T among them
            source = flat.numpy() if isinstance(flat, torch.Tensor) else flat
            buffer[: source.size].numpy()[:] = source.view(np.int8)
            if check is not None:
                check(buffer[: source.size])
            pointer = _pool_id(buffer)
            copies = self._verbatim_panel_copies(buffer) if pointer is None else self._int8_panel_copies[pointer]
            for target, panel_source in copies:
                target.copy_(panel_source)
            return
        if not isinstance(flat, torch.Tensor) or check is not None:
            raise ValueError("packed adapters: only a verbatim plan reads bytes in place")
        whole = flat.view(torch.float32)
        for group, (q_at, scales_at, panels_at) in zip(self.groups, self.int8_layout):
            count, rank, other = group.count, group.rank, group.other
            q = flat[group.q_start : group.q_start + count * rank * other]
            shaped = buffer[q_at : q_at + count * rank * other].view(count, rank, other)
            if group.transposed and not group.source_transposed:  # another packer's B (count, out, r)
                shaped.copy_(q.view(count, other, rank).transpose(1, 2))
            else:
                shaped.view(-1).copy_(q)
            buffer[scales_at : scales_at + 4 * count * rank].view(torch.float32).copy_(
                whole[group.s_start : group.s_start + count * rank]
            )
            if group.transposed:
                self._write_panels(buffer, panels_at, group, shaped)
        if len(self._others_index):
            torch.index_select(whole, 0, self._others_index, out=self._others_in(buffer))

    def _int8_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor of a version written into `buffer` (`_write_int8`), in index order, as fresh views."""
        views = []
        for group, (q_at, scales_at, _) in zip(self.groups, self.int8_layout):
            count, rank, other = group.count, group.rank, group.other
            shaped = buffer[q_at : q_at + count * rank * other].view(count, rank, other)
            scales = buffer[scales_at : scales_at + 4 * count * rank].view(torch.float32).view(count, rank)
            views.append((shaped.transpose(1, 2).unbind(0) if group.transposed else shaped.unbind(0), scales.unbind(0)))
        other_at, offset = {}, 0
        if self._others_at is None:  # at their places in the packed bytes
            whole = buffer.view(torch.float32)
            other_at = {name: whole[start : start + numel].view(shape) for name, start, numel, shape in self._others}
        else:
            others = self._others_in(buffer)
            for name, _, numel, shape in self._others:
                other_at[name] = others[offset : offset + numel].view(shape)
                offset += numel
        decoded = {}
        for name, group, member, _ in self.outputs:
            if group < 0:
                decoded[name] = other_at[name]
                continue
            decoded[name] = views[group][0][member]
            decoded[self.scale_names[name]] = views[group][1][member]
        return decoded

    def _verbatim_panel_copies(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(target, source) view pairs that write B's panels from the B^T among a verbatim plan's bytes in `buffer`
        (`_write_panels`, unscaled), for every transposed group."""
        copies = []
        for group, (q_at, _, panels_at) in zip(self.groups, self.int8_layout):
            if group.transposed:
                shaped = buffer[q_at : q_at + group.count * group.rank * group.other].view(group.count, group.rank, -1)
                copies.extend((target, source) for target, source, _ in _panel_pairs(buffer, panels_at, group, shaped))
        return copies

    @staticmethod
    def _write_panels(
        buffer: torch.Tensor, start: int, group: _Group, source: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """B^T (count, r, out) into its panels (count, ceil(out / 32), r, 32) at `start` in `buffer`, times `scale`
        (count, r, 1) where given, else as it is (`_panel_pairs`)."""
        for target, part, full in _panel_pairs(buffer, start, group, source):
            _fill(target, part, None if scale is None else scale[..., None] if full else scale)

    def _take(self, pool: list[tuple[torch.Tensor, int | None]], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `pool` nothing references any more, else a fresh one (kept in the pool while it has room). A
        buffer kept in the int8 pool gets its views first (`decode_pooled`'s), so that they count among its idle
        users."""
        for buffer, idle in pool:
            if idle is not None and _storage_users(buffer) == idle:
                return buffer
        buffer = torch.zeros(numel, dtype=dtype)  # zeros: the panels' padding
        if len(pool) < BUFFER_SETS:
            pointer = buffer.untyped_storage().data_ptr()
            if pool is self._buffers_int8:
                self._int8_templates[pointer] = self._int8_views(buffer)
                if self.verbatim:
                    self._int8_panel_copies[pointer] = self._verbatim_panel_copies(buffer)
            pool.append((buffer, _storage_users(buffer)))
            _POOLED[pointer] = weakref.ref(buffer)
            _GENERATION[0] += 1
            _PANELS[pointer] = self._panel_index[dtype]
        return buffer


def _panel_pairs(
    buffer: torch.Tensor, start: int, group: _Group, source: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(panels view, B^T view, whether full) pairs that lay B^T (count, r, out) out in panels (count, ceil(out / 32),
    r, 32) at `start` in `buffer`: the full panels in one copy (views (count, r, full, 32)), the last partial one in
    another (its padding columns stay the zeros the buffer was made with)."""
    full, rest = divmod(group.other, PANEL)
    size = group.count * group.panels * group.rank * PANEL
    panels = buffer[start : start + size].view(group.count, group.panels, group.rank, PANEL)
    pairs = []
    if full:
        pairs.append(
            (panels[:, :full].permute(0, 2, 1, 3), source[:, :, : full * PANEL].unflatten(2, (full, PANEL)), True)
        )
    if rest:
        pairs.append((panels[:, full, :, :rest], source[:, :, full * PANEL :], False))
    return pairs


def plan_for(index: torch.Tensor, nbytes: int, entries: Callable[[], list[Entry]]) -> PackedPlan | None:
    """The cached plan of a packed index (its bytes and the buffer's size as the key); `entries()` (the index parsed
    and checked, as `Entry`s) is called only for an index not seen before."""
    key = (index.numpy().tobytes(), nbytes)
    with _PLANS_LOCK:
        if key in _PLANS:
            _PLANS.move_to_end(key)
            return _PLANS[key]
    plan = PackedPlan.build(entries(), nbytes)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan
