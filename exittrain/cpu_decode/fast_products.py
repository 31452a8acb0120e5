"""The CPU's faster products for a decode's few rows, given as explicit options of what runs them.

A plain :class:`~exittrain.decoding.SpeculativeDecoder` runs every linear through ``F.linear``, as
training does. :class:`FastCpuDecoder` is the CPU's decoder, the
:class:`~exittrain.cpu_decode.round_policy.RoundPolicyDecoder` (copy-led rounds, steps after a
miss) whose rounds run:

- the target's decoder linears and LM head, and the drafter's linears, packed once per row bucket
  for MKL's product (:mod:`exittrain.cpu_decode.packed_linears`), kept where they time faster here
  (``packed``, default True);
- the LM head applied to a few rows in the layout this host computes faster
  (:mod:`exittrain.cpu_decode.row_layouts`; ``head_layouts``, default True).

Nothing is patched or installed: the decoder builds its target as
``target.with_options(row_kernels=..., head_product=...)`` (a second
:class:`~exittrain.models.target_model.TargetModel` over the same model, whose tree forwards
take those options) and wraps its drafter in :class:`DrafterWithProducts`, whose decode calls
run the drafter's packs and pass the head product per call
(:meth:`~exittrain.models.drafter.block_drafter.BlockDrafter.draft_block`'s ``head_product``). The
caller's target and drafter are left as they were, and every other user of them (training, the
plain decoder, tree scoring) keeps ``F.linear``.

Packs and layouts are made before the first round's clock starts (:meth:`FastCpuDecoder.products`),
once per process and model (:func:`~exittrain.cpu_decode.packed_linears.packed_for`), and both fall
back to ``F.linear`` wherever they do not apply (a GPU, float types other than float32, rows beyond
their buckets). Outputs equal the plain decoder's up to float summation order; at temperature 0
both equal the target's greedy decoding (the tests compare them). ``decode: auto``'s probe and the
CPU benches decode with it; nothing on the training path does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from exittrain.cpu_decode.packed_linears import PackedLinears, packed_for
from exittrain.cpu_decode.round_policy import RoundPolicyDecoder
from exittrain.cpu_decode.row_layouts import choose_layouts, head_rows

__all__ = ["DrafterWithProducts", "FastCpuDecoder", "RowKernels"]


class RowKernels:
    """The ``row_kernels`` option of a target (``TargetModel(row_kernels=)``) or a
    :class:`DrafterWithProducts`: the packed linears of ``module`` (of ``linears``, default every
    module in it) that :func:`~exittrain.cpu_decode.packed_linears.packed_for` made, as of the last
    :meth:`prepare`. Before the first, every linear runs its own product."""

    def __init__(self, module: nn.Module, linears: Sequence[nn.Module] | None = None):
        self.module, self.linears = module, None if linears is None else list(linears)
        self.packs: PackedLinears | None = None

    def prepare(self, max_rows: int) -> None:
        """Packs for products of up to ``max_rows`` rows, made now where not made yet (remade where a
        weight was written since: a drafter that trained on)."""
        self.packs = packed_for(self.module, max_rows, self.linears)

    def active(self) -> contextlib.AbstractContextManager:
        """The packed forwards while open (:meth:`PackedLinears.active`); nothing before :meth:`prepare`."""
        return contextlib.nullcontext() if self.packs is None else self.packs.active()

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``module(x)`` from its pack, or None where the module's own product must run."""
        return None if self.packs is None else self.packs.apply(module, x)


class DrafterWithProducts:
    """``drafter`` as :class:`FastCpuDecoder`'s rounds run it: each decode call (:meth:`project_context`,
    :meth:`draft_block`, calling it) runs inside ``kernels.active()`` (its packed linears, or None)
    and passes ``head_product`` (None: ``F.linear``) to the drafter's head. Everything a decoder
    reads besides (``config``, ``has_target``, :meth:`attach_target`) is the drafter's; the
    drafter itself is not changed."""

    def __init__(self, drafter, kernels: RowKernels | None = None, head_product=None):
        self.drafter, self.kernels, self.head_product = drafter, kernels, head_product

    @property
    def config(self):
        return self.drafter.config

    @property
    def has_target(self) -> bool:
        return self.drafter.has_target

    def attach_target(self, target, **kwargs) -> DrafterWithProducts:
        self.drafter.attach_target(target, **kwargs)
        return self

    def _active(self):
        return contextlib.nullcontext() if self.kernels is None else self.kernels.active()

    def project_context(self, features_BCF: torch.Tensor, positions_BC: torch.Tensor):
        with self._active():
            return self.drafter.project_context(features_BCF, positions_BC)

    def draft_block(self, *args, **kwargs) -> torch.Tensor:
        with self._active():
            return self.drafter.draft_block(*args, head_product=self.head_product, **kwargs)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with self._active():
            return self.drafter(*args, head_product=self.head_product, **kwargs)


class FastCpuDecoder(RoundPolicyDecoder):
    """:class:`~exittrain.cpu_decode.round_policy.RoundPolicyDecoder` (the plain decoder's
    arguments, and ``copy_lead`` and ``miss_steps``) whose rounds run the CPU's faster products
    (see the module), each an explicit option: ``packed`` (default True) the target's and the
    drafter's linears packed for their rows where that times faster, False ``F.linear`` (the
    reference twin); ``head_layouts`` (default True) the LM heads' few rows in the layout timed
    faster, False ``F.linear`` (the twin).

    :attr:`target` and :attr:`drafter` are what the rounds run (a target with those options, the
    drafter wrapped in :class:`DrafterWithProducts`); the caller's are unchanged."""

    def __init__(self, target, drafter, *args, packed: bool = True, head_layouts: bool = True, **kwargs):
        for key, value in (("packed", packed), ("head_layouts", head_layouts)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be True or False (False: F.linear, the reference twin), got {value!r}")
        product = head_rows if head_layouts else None
        self.target_kernels = RowKernels(target.model, target.tree_linears()) if packed else None
        self.drafter_kernels = RowKernels(drafter) if packed and drafter is not None else None
        fast_target = target.with_options(row_kernels=self.target_kernels, head_product=product)
        fast_drafter = None if drafter is None else DrafterWithProducts(drafter, self.drafter_kernels, product)
        super().__init__(fast_target, fast_drafter, *args, **kwargs)
        self.packed, self.head_layouts = packed, head_layouts

    @contextlib.contextmanager
    def products(self, tree_rows: int) -> Iterator[None]:
        """Makes the packs and head layouts for up to ``tree_rows`` rows (the drafter's: its block
        too) now, before the rounds' clock starts; the rounds then run them through the options
        given at construction."""
        head = self.target.plain_head()
        if self.head_layouts and head is not None:
            choose_layouts(head.weight, range(2, tree_rows + 1))
        if self.target_kernels is not None:
            self.target_kernels.prepare(tree_rows)
        if self.drafter_kernels is not None:
            # the drafter's rows: its block, and the positions a round commits (up to a tree's rows)
            self.drafter_kernels.prepare(max(tree_rows, int(self.drafter.config.block_size)))
        yield
