"""Packed linears: MKL's packed product for a few rows against F.linear, its reference twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exittrain.core import DraftTree
from exittrain.cpu_decode import packed_linears as pl
from exittrain.cpu_decode.fast_products import RowKernels
from exittrain.cpu_decode.packed_linears import PackedLinears
from tests.models.helpers import random_context, random_trees, tiny_target

pytestmark = pytest.mark.skipif(not pl.AVAILABLE, reason="this torch build has no MKL packed product")


def _scripted(monkeypatch, slower: set[int] = frozenset()) -> list[int]:
    """Every bucket's laps scripted: F.linear 2 ms, packed 1 ms, or 3 ms for the buckets in
    ``slower``; returns the list the timed buckets are appended to, in order."""
    timed: list[int] = []
    real = pl.PackedLinears._time

    def time_bucket(self, bucket, rows):
        timed.append(bucket)
        packed_ms = 3.0 if bucket in slower else 1.0
        laps = [d for _ in range(pl.TIMED_REPEATS) for d in (2.0, packed_ms)]
        ticks = iter(t for d in laps for t in (0.0, d / 1e3))
        monkeypatch.setattr(pl, "_clock", lambda: next(ticks))
        real(self, bucket, rows)
        assert next(ticks, None) is None  # TIMED_REPEATS laps of each, no more

    monkeypatch.setattr(pl.PackedLinears, "_time", time_bucket)
    return timed


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24, bias=False), nn.Linear(24, 8)).requires_grad_(False)


@torch.no_grad()
def test_packed_products_equal_f_linear_at_every_row_count_padded_or_not(monkeypatch):
    stack = _stack()
    packed = PackedLinears(list(stack))
    timed = _scripted(monkeypatch)
    packed.prepare(max_rows=10, budget_bytes=1 << 30)
    assert timed == [2, 3, 4, 5, 6, 8, 10]  # the buckets below 10 and the first at or above it
    assert [c["rows"] for c in packed.choices() if c["packed"]] == timed
    # each against F.linear at the fewest rows it serves, where padding costs most
    assert [c["timed_rows"] for c in packed.choices()] == [2, 3, 4, 5, 6, 7, 9]
    # down again: a padded buffer then holds a larger product's rows past M, which must not matter
    for rows in [*range(1, 15), *range(14, 0, -1)]:
        x = torch.randn(1, rows, 24)
        with packed.active():
            fast = stack(x)
            used = packed.apply(stack[0], x) is not None
        torch.testing.assert_close(fast, stack[2](stack[1](F.linear(x, stack[0].weight, stack[0].bias))),
                                   atol=1e-5, rtol=1e-5)
        assert used == (2 <= rows <= 10), rows  # one row and rows past the largest bucket: F.linear
    assert all("forward" not in vars(m) for m in stack)  # the swapped forwards are gone after the block


@torch.no_grad()
def test_a_bucket_slower_than_f_linear_is_dropped_and_its_rows_run_f_linear(monkeypatch):
    stack = _stack()
    packed = PackedLinears(list(stack))
    _scripted(monkeypatch, slower={8})
    packed.prepare(max_rows=7, budget_bytes=1 << 30)
    kept = {c["rows"]: c["packed"] for c in packed.choices()}
    assert kept == {2: True, 3: True, 4: True, 5: True, 6: True, 8: False}
    assert 8 not in packed.packs  # its packs are freed
    with packed.active():
        assert packed.apply(stack[0], torch.randn(7, 24)) is None
        assert packed.apply(stack[0], torch.randn(5, 24)) is not None


@torch.no_grad()
def test_the_budget_drops_the_smallest_buckets_first_and_pads_their_rows_up(monkeypatch):
    stack = _stack()
    packed = PackedLinears(list(stack))
    timed = _scripted(monkeypatch)
    packed.prepare(max_rows=10, budget_bytes=2 * packed.weight_bytes)
    assert timed == [8, 10]
    assert [c["timed_rows"] for c in packed.choices()] == [2, 9]  # bucket 8 serves 2 to 8 rows
    x = torch.randn(2, 24)
    with packed.active():
        torch.testing.assert_close(packed.apply(stack[0], x), F.linear(x, stack[0].weight, stack[0].bias),
                                   atol=1e-5, rtol=1e-5)
    packed.prepare(max_rows=10, budget_bytes=0)  # prepared already: nothing new, nothing lost
    assert timed == [8, 10] and sorted(packed.packs) == [8, 10]


def test_f_linear_runs_outside_the_block_and_where_gradients_flow(monkeypatch):
    stack = _stack()
    packed = PackedLinears(list(stack))
    _scripted(monkeypatch)
    packed.prepare(max_rows=4, budget_bytes=1 << 30)
    x = torch.randn(3, 24)
    assert packed.apply(stack[0], x) is None  # not active
    with packed.active():
        with torch.no_grad():
            assert packed.apply(stack[0], x) is not None
            assert packed.apply(stack[0], x.double()) is None
        assert packed.apply(stack[0], x.requires_grad_()) is None


def test_what_cannot_be_packed_is_left_alone():
    layers = [nn.Linear(8, 8).double(), nn.Conv1d(2, 2, 1), nn.Linear(8, 8)]
    packed = PackedLinears(layers)
    assert packed.linears == [layers[2]]  # float64 and a convolution stay with their own forward
    packed.prepare(max_rows=1, budget_bytes=1 << 30)
    assert packed.choices() == []  # one row needs no pack


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_forward_with_packed_linears_equals_the_unpacked_one(monkeypatch, kind):
    """The target's decoder linears and its LM head run from packs inside tree_forward of a target
    given them as its ``row_kernels`` option, and give the logits F.linear gives (to float
    summation order); the target it was made from runs F.linear."""
    target = tiny_target(kind)
    _scripted(monkeypatch)
    context, root = random_context(2, 9), 5
    tree: DraftTree = random_trees(1, k=4, budget=12, seed=3)
    calls = []
    real_apply = PackedLinears.apply
    monkeypatch.setattr(PackedLinears, "apply", lambda self, m, x: calls.append(real_apply(self, m, x)) or calls[-1])
    kernels = RowKernels(target.model, target.tree_linears())
    packed_target = target.with_options(row_kernels=kernels)
    calls.clear()
    packed_target.tree_forward(packed_target.prefill(torch.tensor([context])).cache, root, tree)
    assert all(c is None for c in calls)  # not prepared yet: every linear's own product
    kernels.prepare(13)
    assert kernels.packs.packs and target.lm_head in kernels.packs.linears
    calls.clear()
    fast = packed_target.tree_forward(packed_target.prefill(torch.tensor([context])).cache, root, tree).logits
    assert calls and all(c is not None for c in calls)  # every linear and the head ran packed (13 rows)
    assert target.row_kernels is None  # the target it was made from: F.linear
    assert not any("forward" in vars(m) for m in target.tree_linears())  # no forward left swapped in
    calls.clear()
    plain = target.tree_forward(target.prefill(torch.tensor([context])).cache, root, tree).logits
    assert calls == []
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_packed_for_keeps_one_per_module_and_remakes_it_after_a_weight_write(monkeypatch):
    stack = _stack()
    timed = _scripted(monkeypatch)
    first = pl.packed_for(stack, 3)
    assert pl.packed_for(stack, 3) is first and timed == [2, 3]  # prepared once
    stack[0].weight.add_(1.0)  # a training step writes in place
    assert not first.current
    again = pl.packed_for(stack, 3)
    assert again is not first and again.current and timed == [2, 3, 2, 3]
    x = torch.randn(3, 24)
    with again.active():
        torch.testing.assert_close(stack[0](x), F.linear(x, stack[0].weight, stack[0].bias), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_nested_blocks_over_a_shared_module_give_each_forward_back(monkeypatch):
    stack = _stack()
    _scripted(monkeypatch)
    outer, inner = PackedLinears(list(stack)), PackedLinears([stack[0]])
    outer.prepare(3, budget_bytes=1 << 30)
    inner.prepare(3, budget_bytes=1 << 30)
    with outer.active():
        swapped = vars(stack[0])["forward"]
        with inner.active():
            assert vars(stack[0])["forward"] is not swapped
        assert vars(stack[0])["forward"] is swapped
    assert "forward" not in vars(stack[0])


def test_greedy_decoding_with_packed_target_and_drafter_equals_the_targets_own(monkeypatch):
    from exittrain.cpu_decode.fast_products import FastCpuDecoder
    from exittrain.decoding import autoregressive_generate
    from exittrain.models import new_drafter

    target = tiny_target("llama", seed=3)
    monkeypatch.setattr(target, "eos_token_ids", [])
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, copy_ngrams=[2, 1])
    _scripted(monkeypatch)
    prompt = [5, 17, 33, 2, 40, 41, 9, 12]
    decoder = FastCpuDecoder(target, drafter, budget=6, verifier="tev", copy_tail=3)
    tokens = decoder.generate(prompt, max_new_tokens=24, temperature=0.0).tokens
    assert decoder.target_kernels.packs.packs and decoder.drafter_kernels.packs.packs  # both ran from packs
    assert decoder.target.row_kernels is decoder.target_kernels and target.row_kernels is None
    assert decoder.drafter.drafter is drafter and not any("forward" in vars(m) for m in drafter.modules())
    assert tokens == autoregressive_generate(target, prompt, 24).tokens
    unpacked = FastCpuDecoder(target, drafter, budget=6, verifier="tev", copy_tail=3, packed=False)
    assert unpacked.target.row_kernels is None and unpacked.drafter.kernels is None  # F.linear, the twin
    assert unpacked.generate(prompt, max_new_tokens=24, temperature=0.0).tokens == tokens
    with pytest.raises(ValueError, match="packed must be True or False"):
        FastCpuDecoder(target, drafter, packed="on")
