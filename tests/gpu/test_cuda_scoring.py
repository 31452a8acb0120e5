"""Tree scoring (``TargetModel.score_trees``) on the device under test against its fp32 CPU reference.

The tiny random targets of tests/models (hidden 32, 3 layers, grouped heads, ``initializer_range=0.2``
so that a wrong mask shows up as a large error), in fp32 and in bf16, exact and windowed, chunked or
not; plus the attention masks that reach SDPA, padding nodes and right-padded sequences.

Tolerances, and why:

- fp32: ``atol=1e-4`` on logits and log-probabilities (features too). The device runs the same fp32
  arithmetic in another order (GEMM tiling, the SDPA kernel; TF32 is off: ``fp32_matmuls``); the
  rounding of logits of size <= ~6 through three layers is ~1e-6, so 1e-4 leaves a 100x margin,
  while a wrong mask moves logits by 1 to 5.
- bf16: every activation keeps 8 significant bits (a relative rounding of 2^-9 per op, some twenty
  ops per layer, sharpened by the peaked attention of ``initializer_range=0.2``). Measured on the CPU,
  bf16 against fp32 over the three families, both modes and three seeds: at most 0.23 on logits whose
  largest magnitude was 3.9 to 6.2 (4.6% of it) and a total variation of at most 0.028 between a row's
  distributions. CUDA rounds to bf16 at the same tensors (its GEMMs and SDPA accumulate in fp32 as the
  CPU's do). Allowed: 15% of the reference's largest logit and a total variation of 0.08, about three
  times the worst measured; a causal mask over the tree (a wrong one) errs by 4.5 and 0.59 there.
"""

from __future__ import annotations

import pytest
import torch

from exittrain.bench.scoring_memory import make_inputs
from exittrain.core import DraftTree
from tests.gpu.helpers import target_on
from tests.models.helpers import TARGET_KINDS, random_context, random_trees, tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

FP32_ATOL = 1e-4
BF16_SCALE_FRACTION, BF16_MAX_TV = 0.15, 0.08
L, T, A, K, B, WINDOW = 2, 40, 4, 4, 12, 16
ANCHORS = torch.tensor([[3, 12, 25, 35], [0, 9, 21, 33]])


def sequences(seed: int, length: int = T) -> torch.Tensor:
    """(L, length) random token ids (2..V-1)."""
    return torch.tensor([random_context(seed * 10 + row, length) for row in range(L)])


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.float().cpu()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=FP32_ATOL, rtol=0)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.float().cpu()
    assert torch.isfinite(got).all(), "bf16 scoring gave NaN or inf"
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= BF16_SCALE_FRACTION * scale, f"max |logit error| {err:.3f} > {BF16_SCALE_FRACTION} x {scale:.2f}"
    tv = float((got.softmax(-1) - want.softmax(-1)).abs().sum(-1).max()) / 2
    assert tv <= BF16_MAX_TV, f"total variation {tv:.4f} > {BF16_MAX_TV}"


@pytest.fixture(scope="module", params=TARGET_KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(kind):
    """The fp32 CPU target of this family."""
    return tiny_target(kind)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("mode", ["exact", "windowed"])
def test_fp32_scoring_on_the_device_equals_the_cpu(kind, reference, mode, chunk_size, device, fp32_matmuls):
    target = target_on(device, kind)
    ids, trees = sequences(1), random_trees(L * A, k=K, budget=B, seed=2)
    layers = [0, 2] if mode == "exact" else None  # features come with exact scoring's causal pass
    want = reference.score_trees(ids, ANCHORS, trees, mode=mode, window=WINDOW, chunk_size=chunk_size, layers=layers)
    got = target.score_trees(ids, ANCHORS, trees, mode=mode, window=WINDOW, chunk_size=chunk_size, layers=layers)
    assert got.logits.device.type == device.type and got.logits.shape == (L * A, B + 1, reference.vocab_size)
    assert_fp32_close(got.logits, want.logits)
    if layers is not None:
        torch.testing.assert_close(got.features.cpu(), want.features, atol=FP32_ATOL, rtol=0)


def test_fp32_scoring_of_a_benchmark_point_with_a_reused_prefix(device, fp32_matmuls):
    """The memory benchmark's inputs (depth-7 trees of 32 nodes over a 128-token sequence), scored in
    uneven chunks over a causal pass computed once (``sequence_prefix``), as the held-out law does."""
    reference, target = tiny_target("llama"), target_on(device)
    ids, anchors, trees = make_inputs(reference, length=128, budget=32, anchors=8, seed=3)
    want = reference.score_trees(ids, anchors, trees, chunk_size=3, layers=[1])
    prefix = target.sequence_prefix(ids, layers=[1])
    got = target.score_trees(ids, anchors, trees, chunk_size=3, layers=[1], prefix=prefix)
    assert all(k.device.type == device.type for pair in prefix.kv for k in pair)
    assert_fp32_close(got.logits, want.logits)
    torch.testing.assert_close(got.features.cpu(), want.features, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["exact", "windowed"])
def test_bf16_scoring_on_the_device_is_close_to_fp32_on_the_cpu(kind, reference, mode, device):
    target = target_on(device, kind, torch.bfloat16)
    for seed in (1, 2):
        ids, trees = sequences(seed), random_trees(L * A, k=K, budget=B, seed=seed)
        got = target.score_trees(ids, ANCHORS, trees, mode=mode, window=WINDOW).logits
        assert got.dtype == torch.bfloat16  # the model dtype (exittrain.models.target_model, "Limits")
        assert_bf16_close(got, reference.score_trees(ids, ANCHORS, trees, mode=mode, window=WINDOW).logits)


def with_padding(trees: DraftTree, columns: int) -> DraftTree:
    """``trees`` with ``columns`` padding nodes appended: token 0, parent 0, depth 0, invalid (DraftTree's padding)."""
    N = trees.num_trees
    pad = torch.zeros(N, columns, dtype=torch.long)
    return DraftTree(
        tokens=torch.cat([trees.tokens, pad], 1),
        parents=torch.cat([trees.parents, pad], 1),
        depths=torch.cat([trees.depths, pad], 1),
        valid=torch.cat([trees.valid, pad.bool()], 1),
        max_depth=trees.max_depth,
        scores=torch.cat([trees.scores, torch.full((N, columns), float("-inf"))], 1),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_nodes_and_right_padded_sequences_change_no_real_row(dtype, device, fp32_matmuls):
    """Padding nodes see only the root and themselves, and a sequence's padding lies after all its
    anchors: on the device, with these in the batch, every real tree row scores as without them
    (and the padding rows themselves are finite)."""
    reference, target = tiny_target("llama"), target_on(device, dtype=dtype)
    assert_close = assert_fp32_close if dtype == torch.float32 else assert_bf16_close
    ids, trees = sequences(3), random_trees(L * A, k=K, budget=B, seed=4)
    lengths = [T, 36]  # row 1 ends at 36, after all its anchors, and is right-padded with junk
    assert int(ANCHORS[1].max()) < lengths[1]
    padded_ids = ids.clone()
    padded_ids[1, lengths[1] :] = torch.randint(2, reference.vocab_size, (T - lengths[1],))
    got = target.score_trees(padded_ids, ANCHORS, with_padding(trees, 5)).logits  # (L*A, B+1+5, V)
    assert torch.isfinite(got.float()).all(), "a padding row or a real row is NaN or inf"
    want = reference.score_trees(ids, ANCHORS, trees).logits
    assert_close(got[:, : B + 1], want)
    # row 1 alone, cut at its length, gives the same scores as inside the right-padded batch
    alone = reference.score_trees(ids[1:, : lengths[1]], ANCHORS[1:], trees.index(slice(A, 2 * A))).logits
    assert_close(got[A:, : B + 1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_masks_sdpa_receives_are_on_the_device_in_the_model_dtype(dtype, device, monkeypatch):
    """Every attention call of a tree forward gets its mask on the query's device, additive in the model
    dtype (finite: ``finfo.min``, not -inf) or boolean, and with at least one visible key per row, so
    the softmax of no row is 0/0. Only exact scoring's causal pass over the sequences may run unmasked,
    as ``is_causal``."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((query.shape[-2], query.dtype, query.device, attn_mask, kwargs.get("is_causal", False)))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    target = target_on(device, dtype=dtype)
    ids, trees = sequences(5), with_padding(random_trees(L * A, k=K, budget=B, seed=6), 3)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    for mode in ("exact", "windowed"):
        logits = target.score_trees(ids, ANCHORS, trees, mode=mode, window=WINDOW, chunk_size=2).logits
        assert torch.isfinite(logits.float()).all()
    monkeypatch.undo()
    # per layer: the causal pass over the T = 40 sequence positions (unmasked and ``is_causal``, or with the
    # causal mask transformers builds), then one tree forward per chunk of 2 anchors (exact: 2 x 16 rows of
    # trees with padding) or of 2 trees (windowed: 16 window + 16 tree rows), never T rows
    layers = target.num_layers
    assert len(calls) == layers * (1 + A // 2 + L * A // 2), len(calls)
    causal = [c for c in calls if c[0] == T]
    assert len(causal) == layers and all(mask is not None or is_causal for *_, mask, is_causal in causal)
    trees_calls = [c for c in calls if c[0] != T]
    assert all(mask is not None for *_, mask, _ in trees_calls), "a tree forward ran without its tree mask"
    for _, query_dtype, query_device, mask, _ in trees_calls:
        assert query_dtype == dtype and mask.device == query_device
        if mask.dtype == torch.bool:
            visible = mask
        else:
            assert mask.dtype == dtype and torch.isfinite(mask).all(), (mask.dtype, float(mask.min()))
            visible = mask > torch.finfo(dtype).min / 2
        assert visible.any(-1).all(), "a query row sees no key"
