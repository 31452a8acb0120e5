"""``x @ W.T`` for a few rows against a wide weight (an LM head), in the layout this host runs faster.

Why: a drafter round applies the target's LM head (V x H, V ~ 50k-150k) to its K block rows, and
the tree forward to its B + 1 rows. On CPUs the BLAS kernel ``F.linear`` picks for a handful of
rows can be several times slower than the same product computed as ``(W @ x.T).T``: measured here
(AMD EPYC, 2 threads, MKL, fp32, V = 49152, H = 576) 35 ms against 9 ms for 7 rows, alike with and
without the AVX2 emulation, and no difference for one row or for the decoder layers' own weights.
Which layout wins depends on the library, the CPU and the row count, so nothing is assumed:

:func:`head_rows` times both layouts per (rows, weight shape, dtype, threads) on first use, each
:data:`TIMED_REPEATS` times after a warm-up call, the two layouts taking turns, and keeps the one
with the lower median: one noisy first call (a page fault, another process's burst) moves a
median of five no more than one sample, where a single timing would stick for the whole run.
The choice is cached for the process. A GPU, a product that needs gradients, or more than
:data:`MAX_ROWS` rows always takes ``F.linear``, the reference twin; so does a decoder that is
not given :func:`head_rows` as its head product (``FastCpuDecoder(head_layouts=False)``). Both
compute the same dot products; the results differ by float summation order only (the tests bound
it). :func:`layout_choices` reports what was chosen, for the benchmarks' host line.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from exittrain.timing import alternating_medians

__all__ = ["MAX_ROWS", "TIMED_REPEATS", "choose_layouts", "head_rows", "layout_choices"]

MAX_ROWS = 64  # beyond this many rows the kernels are compute-bound and F.linear is as good
TIMED_REPEATS = 5  # timed calls per layout after the warm-up; the median decides
_WIN_MARGIN = 0.9  # the transposed layout must be 10% faster to be picked: noise does not flip it

# (rows, V, H, dtype, threads) -> (transposed?, linear ms, transposed ms)
_CHOICES: dict[tuple, tuple[bool, float, float]] = {}
_clock = time.perf_counter  # what _time_layouts reads; tests replace it


def _transposed(x_MH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    # contiguous: the softmax and the copy mix that follow read rows; the copy is M x V floats, ~1%
    # of the product's time
    return (weight_VH @ x_MH.T).T.contiguous()


def _time_layouts(x_MH: torch.Tensor, weight_VH: torch.Tensor, clock=None) -> tuple[float, float]:
    """(F.linear ms, transposed ms): the median of :data:`TIMED_REPEATS` timed calls of each layout,
    taking turns after one warm-up call each (:func:`~exittrain.timing.alternating_medians`).
    ``clock`` (seconds, default :data:`_clock`) is injectable: tests script it."""
    linear_ms, transposed_ms = alternating_medians(
        (lambda: F.linear(x_MH, weight_VH), lambda: _transposed(x_MH, weight_VH)), TIMED_REPEATS,
        _clock if clock is None else clock)
    return linear_ms, transposed_ms


def _key(rows: int, weight_VH: torch.Tensor) -> tuple:
    return (rows, *weight_VH.shape, weight_VH.dtype, torch.get_num_threads())


def _choose(x_MH: torch.Tensor, weight_VH: torch.Tensor) -> bool:
    key = _key(x_MH.shape[0], weight_VH)
    if key not in _CHOICES:
        linear_ms, transposed_ms = _time_layouts(x_MH, weight_VH)
        _CHOICES[key] = (transposed_ms < _WIN_MARGIN * linear_ms, linear_ms, transposed_ms)
    return _CHOICES[key][0]


def choose_layouts(weight_VH: torch.Tensor, row_counts) -> None:
    """Make :func:`head_rows`' choice now for each of ``row_counts`` not chosen yet, as its first
    call would: a decoder calls it before its first round for every tree size it can verify.

    Why: each choice times 12 products (0.2-0.4 s a count for a 49k-token head on a 2-core CPU),
    and a tree with a copy tail takes many sizes (B = 16 with a tail of 10: up to 27 rows). Chosen
    on first use, the choices land inside timed rounds: a short decode pays them where a long one
    would not, and ``decode: auto``'s probe, which timed other rounds, does not see them. Counts
    the fast path never takes (1, more than :data:`MAX_ROWS`) and a GPU weight are skipped, as in
    :func:`head_rows`."""
    if weight_VH.device.type != "cpu":
        return
    generator = torch.Generator().manual_seed(0)
    for rows in sorted(set(row_counts)):
        if 1 < rows <= MAX_ROWS and _key(rows, weight_VH) not in _CHOICES:
            _choose(torch.randn(rows, weight_VH.shape[1], generator=generator).to(weight_VH.dtype), weight_VH)


def head_rows(x: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight_VH)`` for ``x`` (..., H) -> (..., V), no bias, in the faster layout (see the module)."""
    x_MH = x.reshape(-1, x.shape[-1])
    fast = (
        x.device.type == "cpu"
        and 1 < x_MH.shape[0] <= MAX_ROWS
        and not (torch.is_grad_enabled() and (x.requires_grad or weight_VH.requires_grad))
        and x.dtype == weight_VH.dtype
    )
    if not fast or not _choose(x_MH, weight_VH):
        return F.linear(x, weight_VH)
    return _transposed(x_MH, weight_VH).reshape(*x.shape[:-1], weight_VH.shape[0])


def layout_choices() -> list[dict]:
    """What :func:`head_rows` measured and chose so far, one dict per row count and weight."""
    return [{"rows": k[0], "weight": [k[1], k[2]], "dtype": str(k[3]).removeprefix("torch."), "threads": k[4],
             "layout": "W @ x.T" if t else "F.linear", "linear_ms": round(a, 2), "transposed_ms": round(b, 2)}
            for k, (t, a, b) in _CHOICES.items()]
