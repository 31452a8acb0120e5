"""The LM head in the faster layout: the same numbers as F.linear (its reference twin) in either
layout, F.linear wherever the fast path does not apply, and the tree forward and the drafter head
unchanged by it when they are given it as their head product (an explicit option, never installed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exittrain.core import DraftTree
from exittrain.cpu_decode import row_layouts as rm
from exittrain.models import head_product, new_drafter
from tests.models.helpers import random_context, random_trees, tiny_target


@pytest.fixture
def forced(monkeypatch):
    """force(True | False): every head_rows call takes the transposed layout, or F.linear."""
    def force(transposed: bool):
        monkeypatch.setattr(rm, "_choose", lambda x, w: transposed)
    return force


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(7, 24), (1, 9, 24), (3, 2, 24)])
def test_either_layout_gives_f_linear_up_to_summation_order(forced, transposed, shape):
    forced(transposed)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(500, 24, generator=g)
    got = rm.head_rows(x, w)
    assert got.shape == (*shape[:-1], 500)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_the_fast_path_stays_out_of_autograd_single_rows_and_wide_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(rm, "_choose", lambda x, w: calls.append(x.shape[0]) or True)
    w = torch.randn(50, 8)
    x = torch.randn(4, 8, requires_grad=True)
    y = rm.head_rows(x, w)  # gradients needed: F.linear, differentiable
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 8))
    rm.head_rows(torch.randn(1, 8), w)  # one row: no choice to make
    rm.head_rows(torch.randn(rm.MAX_ROWS + 1, 8), w)
    assert calls == []
    with torch.no_grad():
        rm.head_rows(x, w)
    assert calls == [4]


def test_the_choice_is_timed_once_per_shape_and_reported(monkeypatch):
    """Both layouts are timed once per row count, the choice follows the timings (with the win
    margin) and is cached, and the report says what was measured. The timer is scripted: what the
    code guarantees must not depend on how fast this host multiplies (a real 5 x 16 product can
    time at 0.00 ms once rounded)."""
    rm._CHOICES.clear()
    # (linear ms, transposed ms) per row count: 5 rows -> transposed wins by more than the margin,
    # 10 rows -> transposed is faster but within the margin, so F.linear stays
    scripted = {5: [2.0, 1.0], 10: [2.0, 1.9]}
    timed = []

    def fake_timer(x_MH, weight_VH):
        timed.append(x_MH.shape[0])
        return scripted[x_MH.shape[0]]

    monkeypatch.setattr(rm, "_time_layouts", fake_timer)
    w = torch.randn(300, 16)
    for _ in range(3):
        rm.head_rows(torch.randn(5, 16), w)
    rm.head_rows(torch.randn(2, 5, 16), w)  # 10 rows: a second shape, a second choice
    assert timed == [5, 10]  # both layouts timed once per shape; the later calls reuse the choice
    (five, ten) = rm.layout_choices()
    assert five["rows"] == 5 and ten["rows"] == 10 and five["weight"] == [300, 16]
    assert (five["layout"], five["linear_ms"], five["transposed_ms"]) == ("W @ x.T", 2.0, 1.0)
    assert (ten["layout"], ten["linear_ms"], ten["transposed_ms"]) == ("F.linear", 2.0, 1.9)
    rm._CHOICES.clear()


def test_the_choice_follows_the_median_of_the_timed_calls_not_one_lucky_call(monkeypatch):
    """A scripted clock: F.linear's first timed call is fast (0.5 ms) and the rest slow (2 ms), the
    transposed layout steady at 1.5 ms. A best-of or single timing would keep F.linear for the
    run; the median (2 ms against 1.5 ms) picks the transposed layout. The layouts take turns."""
    linear = [0.5] + [2.0] * (rm.TIMED_REPEATS - 1)
    transposed = [1.5] * rm.TIMED_REPEATS
    durations = [d for pair in zip(linear, transposed) for d in pair]  # the order the laps are taken in
    ticks = iter(t for d in durations for t in (0.0, d / 1e3))  # (start, end) seconds of each lap

    monkeypatch.setattr(rm, "_clock", lambda: next(ticks))
    rm._CHOICES.clear()
    w, x = torch.randn(300, 16), torch.randn(6, 16)
    torch.testing.assert_close(rm.head_rows(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    (six,) = rm.layout_choices()
    assert (six["layout"], six["linear_ms"], six["transposed_ms"]) == ("W @ x.T", 2.0, 1.5)
    assert next(ticks, None) is None  # exactly TIMED_REPEATS laps of each layout were timed
    rm._CHOICES.clear()


def test_a_real_timing_picks_a_layout_and_keeps_it():
    """Unscripted: the real timer runs and one of the two layouts is chosen and reported; no
    assertion on the timings themselves (they may round to 0 on a fast host)."""
    rm._CHOICES.clear()
    w = torch.randn(300, 16)
    x = torch.randn(5, 16)
    torch.testing.assert_close(rm.head_rows(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    (five,) = rm.layout_choices()
    assert five["layout"] in ("F.linear", "W @ x.T") and five["linear_ms"] >= 0 and five["transposed_ms"] >= 0
    rm.head_rows(x, w)
    assert len(rm.layout_choices()) == 1
    rm._CHOICES.clear()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_forward_logits_equal_the_models_own_in_either_layout(forced, kind, transposed):
    target = tiny_target(kind)
    context, root = random_context(2, 9), 5
    tree: DraftTree = random_trees(1, k=4, budget=12, seed=3)
    forced(transposed)
    fast_target = target.with_options(head_product=rm.head_rows)  # as a CPU decode's rounds run it
    assert target.head_product is None  # the target it was made from is unchanged
    fast = fast_target.tree_forward(fast_target.prefill(torch.tensor([context])).cache, root, tree).logits
    # the reference: the causal LM's own forward, its own head
    target._causal_lm_logits = lambda **kw: target.model(**kw).logits
    want = target.tree_forward(target.prefill(torch.tensor([context])).cache, root, tree).logits
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_drafter_head_equals_the_target_head_module(forced, transposed):
    target = tiny_target("llama")
    drafter = new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=0).eval()
    hidden = torch.randn(2, 3, target.hidden_size)
    forced(transposed)
    with torch.no_grad():
        fast = drafter.head(hidden, head_product=rm.head_rows)
        torch.testing.assert_close(fast, target.lm_head(hidden), atol=1e-5, rtol=1e-5)


def test_only_a_plain_head_of_a_known_model_type_is_computed_here(monkeypatch):
    assert head_product.is_plain_head(torch.nn.Linear(4, 9, bias=False))
    assert not head_product.is_plain_head(torch.nn.Linear(4, 9, bias=True))
    hooked = torch.nn.Linear(4, 9, bias=False)
    hooked._hf_hook = object()  # accelerate dispatched or offloaded it: the weight may not be in place
    assert not head_product.is_plain_head(hooked)

    called = []
    target = tiny_target("llama").with_options(head_product=lambda *a: called.append(1) or F.linear(*a))
    tree = random_trees(1, k=3, budget=6, seed=1)
    target.tree_forward(target.prefill(torch.tensor([random_context(3, 7)])).cache, 5, tree)
    assert called == [1]
    target.config.model_type = "gemma2"  # soft-capped logits: the model's own forward, not the plain head
    target.tree_forward(target.prefill(torch.tensor([random_context(3, 7)])).cache, 5, tree)
    assert called == [1]


def test_choices_are_made_up_front_for_every_tree_size_a_decoder_can_verify(monkeypatch):
    """choose_layouts times each count the fast path can take, once; the CPU's fast decoder calls it
    before its first round, for 2 .. its tree rows (scripted timer). The plain decoder, the one
    training's decode check runs, and the fast decoder made with ``head_layouts=False`` (the
    reference twin), time nothing."""
    from exittrain.cpu_decode.fast_products import FastCpuDecoder
    from exittrain.decoding import SpeculativeDecoder

    timed = []
    monkeypatch.setattr(rm, "_time_layouts", lambda x, w: timed.append((x.shape[0], w.shape[0])) or (1.0, 2.0))
    rm._CHOICES.clear()
    w = torch.randn(300, 16)
    rm.choose_layouts(w, [1, 3, 2, 3, rm.MAX_ROWS + 1])  # one row and too many rows: never the fast path
    assert timed == [(2, 300), (3, 300)]
    rm.choose_layouts(w, [2, 4])
    assert timed[2:] == [(4, 300)]  # 2 was chosen already

    timed.clear()
    rm._CHOICES.clear()
    target = tiny_target("llama")
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0).eval()
    vocab = target.lm_head.weight.shape[0]
    plain = SpeculativeDecoder(target, drafter, budget=3, copy_tail=2).generate([5, 6, 7, 8, 5, 6], 4).tokens
    assert timed == [] and rm.layout_choices() == []
    twin = FastCpuDecoder(target, drafter, budget=3, copy_tail=2, head_layouts=False, packed=False)
    assert twin.generate([5, 6, 7, 8, 5, 6], 4).tokens == plain and timed == []
    assert twin.target.head_product is None and twin.target.row_kernels is None
    fast = FastCpuDecoder(target, drafter, budget=3, copy_tail=2).generate([5, 6, 7, 8, 5, 6], 4).tokens
    assert fast == plain
    head_counts = [rows for rows, v in timed if v == vocab]
    assert head_counts[:5] == [2, 3, 4, 5, 6]  # 3 nodes + a tail of 2 + the root: chosen before any round
    assert len(head_counts) == len(set(head_counts))  # and none of them again during the rounds
    assert target.head_product is None and target.row_kernels is None  # the caller's target is unchanged
    rm._CHOICES.clear()
