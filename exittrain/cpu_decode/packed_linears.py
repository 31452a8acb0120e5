"""A model's linears on a few rows, from weights packed once for MKL's matrix product.

Why: a round's tree forward runs every linear of the target's decoder layers on its 2-30 rows
(the root, the tree's nodes, a copy tail). On x86 CPUs torch's ``F.linear`` hands such a product
to MKL's GEMM, which rearranges ("packs") the whole weight into its kernel's layout at every call;
one row goes to a matrix-vector product that streams the weight once. MKL can pack a weight once
and multiply against the packed copy thereafter (``cblas_sgemm_pack``/``cblas_sgemm_compute``),
which torch exposes as ``torch.ops.mkl._mkl_reorder_linear_weight`` and ``torch.ops.mkl._mkl_linear``.
Measured over the 210 decoder linears of SmolLM2-135M on a 2-core Xeon (AMX host, fp32; cost
against one row through ``F.linear``; docs/notebook/2026-12-03-packed-linears.md):

============  =======  =======  =======  =======
rows          2        4        8        16
============  =======  =======  =======  =======
AVX512 plain  1.04x    1.56x    2.01x    2.49x
AVX512 packed 1.12x    1.14x    1.29x    1.58x
AVX2 plain    1.61x    2.04x    2.32x    3.01x
AVX2 packed   1.02x    1.25x    1.48x    1.97x
============  =======  =======  =======  =======

(AVX2: under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.)

The contract and its limits:

- A pack serves the one row count it was made for (MKL's packed layout depends on it) and holds
  about as many bytes as the weight. So row counts are bucketed (:data:`ROW_BUCKETS`): a product
  of M rows runs in the smallest bucket P >= M, its input written into a kept buffer of P rows,
  and the first M output rows are returned. A bucket is packed for every linear, so it costs the bytes of
  all of them (425 MB for SmolLM2-135M in fp32); :meth:`PackedLinears.prepare` fits the buckets
  into a byte budget, dropping the smallest first.
- Nothing is assumed about the host: each bucket, padding included, is timed against ``F.linear``
  at the fewest rows it serves (one more than the bucket below it: the case padding costs most;
  every linear once per pass, :data:`TIMED_REPEATS` passes after a warm-up, taking turns, the
  median) and kept only when packed is :data:`_WIN_MARGIN` faster; a dropped bucket's rows go to
  ``F.linear`` and its packs are freed.
- ``F.linear`` is the reference twin and the fallback: for one row, rows beyond the largest
  bucket, a float type other than float32, a GPU, a product that needs gradients, a module with
  an accelerate hook, a torch without MKL (:data:`AVAILABLE`), and wherever no pack is asked for
  (``FastCpuDecoder(packed=False)``, :mod:`exittrain.cpu_decode.fast_products`, is the twin).
  Both compute the same dot products; they differ by float summation order only.
- Packs are made for the weights as they are when prepared: a module whose weight changes
  afterwards (training) must be prepared again. The forwards are swapped in only inside
  :meth:`PackedLinears.active`, which only the objects given the packs as an option enter (a
  target's ``row_kernels``, :class:`~exittrain.cpu_decode.fast_products.DrafterWithProducts`), so
  training forwards never see them.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from exittrain.timing import alternating_medians

__all__ = ["AVAILABLE", "ROW_BUCKETS", "TIMED_REPEATS", "PackedLinears", "packed_choices", "packed_for"]

AVAILABLE = bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
"""Whether this torch build carries MKL's packed product (x86 builds do; ARM and macOS ones do not)."""

ROW_BUCKETS = (2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
"""The row counts packs are made for; a product of M rows runs in the smallest one >= M."""

TIMED_REPEATS = 5  # timed passes per layout and bucket after the warm-up; the median decides
_WIN_MARGIN = 0.9  # packed must be 10% faster than F.linear for its bucket to be kept
_clock = None  # what prepare's timing reads (None: time.perf_counter); tests script it
log = logging.getLogger("exittrain")


def _packable(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and not hasattr(module, "_hf_hook") and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and (module.bias is None or module.bias.dtype == torch.float32))


class PackedLinears:
    """The packed weights of ``modules`` (the ``nn.Linear`` among them that can be packed) per row
    bucket, and the swapped-in forwards that use them (see the module docstring)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.linears: list[nn.Linear] = [m for m in modules if _packable(m)]
        self.packs: dict[int, list[torch.Tensor]] = {}  # bucket -> one pack per linear
        # bucket -> (kept, F.linear ms, packed ms, the rows both were timed at)
        self.timings: dict[int, tuple[bool, float, float, int]] = {}
        self._bucket_of: dict[int, int | None] = {}  # rows -> the bucket they run in, None: F.linear
        self._pads: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, in features) -> the padded input
        self._index = {id(m): i for i, m in enumerate(self.linears)}
        self._active = False
        self._versions = self._weight_versions()  # packs copy the weights as they are now

    def _weight_versions(self) -> tuple[int, ...]:
        # torch bumps a tensor's version at every in-place write: an optimizer step, load_state_dict
        return tuple(t._version for m in self.linears for t in (m.weight, m.bias) if t is not None)

    @property
    def current(self) -> bool:
        """Whether no weight has been written since the packs were made."""
        return self._versions == self._weight_versions()

    @property
    def weight_bytes(self) -> int:
        """The bytes of one bucket's packs, about those of the weights."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.linears)

    def prepare(self, max_rows: int, budget_bytes: int | None = None) -> None:
        """Pack and time the buckets that products of 2 to ``max_rows`` rows need (those of
        :data:`ROW_BUCKETS` up to the first >= ``max_rows``), unless prepared already; rows beyond
        the largest bucket stay with ``F.linear``. ``budget_bytes`` caps the new packs' bytes (None:
        half of the memory available now); when the buckets do not fit, the smallest are dropped
        first, their rows padded up to the next bucket. A no-op without :data:`AVAILABLE`."""
        if not AVAILABLE or not self.linears or max_rows < 2:
            return
        if budget_bytes is None:
            budget_bytes = _available_bytes() // 2
        wanted = [b for b in ROW_BUCKETS if b < max_rows] + [b for b in ROW_BUCKETS if b >= max_rows][:1]
        affordable = budget_bytes // max(self.weight_bytes, 1)
        new = [b for b in wanted if b not in self.timings]
        new = new[len(new) - min(len(new), affordable):]  # the largest that fit
        if not new:  # prepared already, or nothing fits: the buckets and their rows stand
            return
        buckets = sorted({*self.timings, *new})
        for bucket in new:
            below = [b for b in buckets if b < bucket]
            self._time(bucket, below[-1] + 1 if below else 2)
        slower = [b for b in new if not self.timings[b][0]]
        unaffordable = [b for b in wanted if b not in self.timings]
        log.info("packed linears: %d linears, %.0f MB a row bucket; packed for rows %s%s%s", len(self.linears),
                 self.weight_bytes / 2**20, [b for b in new if b not in slower],
                 f"; F.linear timed faster at {slower}" if slower else "",
                 f"; past the memory budget: {unaffordable}" if unaffordable else "")
        kept = sorted(b for b in self.timings if self.timings[b][0])
        self._bucket_of = {}
        for rows in range(2, buckets[-1] + 1):
            bucket = next(b for b in buckets if b >= rows)
            self._bucket_of[rows] = bucket if bucket in kept else None

    def _time(self, bucket: int, rows: int) -> None:
        """Pack ``bucket`` and time it, on ``rows`` rows padded up, against ``F.linear`` on them."""
        packs = [torch.ops.mkl._mkl_reorder_linear_weight(m.weight, bucket) for m in self.linears]
        generator = torch.Generator().manual_seed(bucket)
        inputs = {n: torch.randn(rows, n, generator=generator) for n in {m.in_features for m in self.linears}}

        def plain():
            for m in self.linears:
                F.linear(inputs[m.in_features], m.weight, m.bias)

        def packed():
            for m, pack in zip(self.linears, packs):
                self._product(inputs[m.in_features], pack, m, bucket)

        with torch.no_grad():
            plain_ms, packed_ms = alternating_medians((plain, packed), TIMED_REPEATS, _clock)
        kept = packed_ms < _WIN_MARGIN * plain_ms
        self.timings[bucket] = (kept, plain_ms, packed_ms, rows)
        if kept:
            self.packs[bucket] = packs

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``module(x)`` for ``x`` (..., in) -> (..., out) from its pack, where :meth:`active` is
        open and a kept bucket holds the rows; None where the caller's own product must run (see
        the module docstring for every such case)."""
        index = self._index.get(id(module))
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        bucket = self._bucket_of.get(rows)
        if (index is None or bucket is None or not self._active or x.dtype != torch.float32
                or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        out_MO = self._product(x.reshape(rows, x.shape[-1]), self.packs[bucket][index], module, bucket)
        return out_MO.reshape(*x.shape[:-1], module.out_features)

    def _product(self, x_MI: torch.Tensor, pack: torch.Tensor, module: nn.Linear, bucket: int) -> torch.Tensor:
        """``module(x_MI)`` (M, in) -> (M, out) from its pack for ``bucket`` >= M rows.

        Fewer rows are written into one input buffer of ``bucket`` rows per width, kept for the
        object's life: one copy per product where a fresh zero-padded input cost an allocation,
        a fill and a concatenation, 211 times a forward of SmolLM2-135M. Its rows past M may hold
        an earlier product's: each output row depends on its own input row only, and only the
        first M are returned."""
        rows, width = x_MI.shape
        if rows < bucket:
            padded = self._pads.get((bucket, width))
            if padded is None:
                padded = self._pads[bucket, width] = x_MI.new_zeros(bucket, width)
            padded[:rows].copy_(x_MI)
            x_MI = padded
        return torch.ops.mkl._mkl_linear(x_MI, pack, module.weight, module.bias, bucket)[:rows]

    def _forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.apply(module, x)
        return F.linear(x, module.weight, module.bias) if out is None else out

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block calling a linear runs :meth:`apply`, else ``F.linear`` (instance
        attributes swapped in for the modules' forwards, removed on exit)."""
        if not self.packs or self._active:
            yield
            return
        before = [vars(module).get("forward") for module in self.linears]  # another block's, when nested
        for module in self.linears:
            module.forward = lambda x, module=module: self._forward(module, x)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for module, forward in zip(self.linears, before):
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward

    def choices(self) -> list[dict]:
        """What :meth:`prepare` measured per bucket, for the benchmarks' host record."""
        return [{"rows": b, "timed_rows": r, "linears": len(self.linears), "packed": kept, "linear_ms": round(a, 2),
                 "packed_ms": round(p, 2)} for b, (kept, a, p, r) in sorted(self.timings.items())]


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its PackedLinears


def packed_for(module: nn.Module, max_rows: int, linears: Sequence[nn.Module] | None = None) -> PackedLinears:
    """The :class:`PackedLinears` of ``linears`` (default: every module in ``module``), prepared for
    ``max_rows``: one per ``module`` for the process, remade when a weight has been written since
    it was packed (a drafter that trained on), so packs never lag the weights. Pass the same
    ``linears`` for a module at every call."""
    packed = _PACKED.get(module)
    if packed is None or not packed.current:
        packed = _PACKED[module] = PackedLinears(list(module.modules()) if linears is None else linears)
    packed.prepare(max_rows)
    return packed


def packed_choices(module: nn.Module) -> list[dict]:
    """:meth:`PackedLinears.choices` of ``module``'s packs made by :func:`packed_for`; [] where none were."""
    packed = _PACKED.get(module)
    return [] if packed is None else packed.choices()


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo, in bytes; 0 where it cannot be read (no packs then)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
