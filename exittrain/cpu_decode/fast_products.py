"""The CPU's faster products for a decode's few rows, entered for the length of a decode.

A plain :class:`~exittrain.decoding.SpeculativeDecoder` runs every linear through ``F.linear``, as
training does. :class:`FastCpuDecoder` is the CPU's decoder, the
:class:`~exittrain.cpu_decode.round_policy.RoundPolicyDecoder` (copy-led rounds, steps after a
miss) with, around its rounds:

- the target's decoder linears and LM head, and the drafter's linears, packed once per row bucket
  for MKL's product (:mod:`exittrain.cpu_decode.packed_linears`), kept where they time faster here;
- the LM head applied to a few rows in the layout this host computes faster
  (:mod:`exittrain.cpu_decode.row_layouts`), through the hook of
  :mod:`exittrain.models.head_product`.

Both are made once per process and model, before the first round's clock starts, and both fall back
to ``F.linear`` wherever they do not apply (a GPU, float types other than float32, rows beyond
their buckets). Outputs equal the plain decoder's up to float summation order; at temperature 0
both equal the target's greedy decoding (the tests compare them). ``decode: auto``'s probe and the
CPU benches decode with it; nothing on the training path does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from exittrain.cpu_decode.packed_linears import packed_for
from exittrain.cpu_decode.round_policy import RoundPolicyDecoder
from exittrain.cpu_decode.row_layouts import choose_layouts, head_rows
from exittrain.models.head_product import installed_head_product

__all__ = ["FastCpuDecoder", "fast_products"]


@contextlib.contextmanager
def fast_products(target, drafter=None, max_rows: int = 2) -> Iterator[None]:
    """Within the block a tree forward of ``target`` (up to ``max_rows`` rows) and ``drafter``'s
    forwards run the faster products (see the module); made now, outside any timed round. The
    target's :attr:`~exittrain.models.target_model.TargetModel.row_kernels` is restored on exit."""
    head = target.plain_head()
    if head is not None:
        choose_layouts(head.weight, range(2, max_rows + 1))
    target_packs = packed_for(target.model, max_rows, target.tree_linears())
    # the drafter's rows: its block, and the positions a round commits (up to a tree's rows)
    drafter_packs = None if drafter is None else packed_for(drafter, max(max_rows, int(drafter.config.block_size)))
    before, target.row_kernels = target.row_kernels, target_packs
    try:
        with installed_head_product(head_rows), (
                contextlib.nullcontext() if drafter_packs is None else drafter_packs.active()):
            yield
    finally:
        target.row_kernels = before


class FastCpuDecoder(RoundPolicyDecoder):
    """:class:`~exittrain.cpu_decode.round_policy.RoundPolicyDecoder` (the plain decoder's
    arguments, and ``copy_lead`` and ``miss_steps``) whose rounds run :func:`fast_products`."""

    def products(self, tree_rows: int):
        return fast_products(self.target, self.drafter, tree_rows)
