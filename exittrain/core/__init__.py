"""Pure math of exit-guided draft trees: torch and the standard library only.

- :mod:`.tree`     DDTree construction (batched, exact) and tree tensors
- :mod:`.chain`    the drafter's greedy chain as a tree: the draft a serving engine verifies,
                   and the rounds of a greedy decode walked off per-position acceptance
- :mod:`.exit_law` reach, missing probability, exit mass, expected block length
- :mod:`.verify`   greedy, predraw-and-follow, sequential residual and TEV verifiers
- :mod:`.losses`   block cross-entropy and the ExitTrain node losses
- :mod:`.ngram_copy` the drafter's n-gram copy branch: context lookup and mixture
- :mod:`.anchors`  where the training blocks start: seeded anchor sampling
- :mod:`.tree_metrics` subsets of a batch of trees and the means of their exit law
- :mod:`.resample` the prompt bootstrap of a pooled ratio (tau, a speedup), and the crossed
                   bootstrap over training seeds and prompts
"""

from .anchors import anchor_generator, sample_anchors, sample_anchors_reference
from .chain import TREE_SHAPES, chain_tree, chain_tree_reference, graft_chain, greedy_walk, shaped_tree
from .exit_law import ExitLaw, exit_law, exit_law_reference
from .losses import (
    WEIGHT_TYPES,
    block_cross_entropy,
    block_cross_entropy_reference,
    exit_node_loss,
    exit_node_loss_reference,
    mix_soft_labels,
    sample_vocabulary,
    sampled_block_cross_entropy,
    sampled_block_cross_entropy_reference,
)
from .ngram_copy import check_ngrams, mix_copy, mix_copy_reference, ngram_lookup, ngram_lookup_reference
from .resample import (
    CROSSED_DRAWS,
    CROSSED_ENDPOINTS,
    bootstrap_ci,
    crossed_paired_difference,
    crossed_paired_difference_reference,
    paired_pooled_difference,
    paired_pooled_difference_reference,
    pooled,
    prompt_totals,
    resampled_ratios,
    resampled_ratios_reference,
)
from .tree import DraftTree, build_tree, build_tree_reference, followed_depth, followed_depth_reference
from .tree_metrics import select_trees, tree_metrics, tree_metrics_reference
from .verify import (
    VERIFIERS,
    Verdict,
    sample_categorical,
    verify_greedy,
    verify_predraw,
    verify_sequential,
    verify_tev,
    warp_probs,
)

__all__ = [
    "CROSSED_DRAWS",
    "CROSSED_ENDPOINTS",
    "bootstrap_ci",
    "crossed_paired_difference",
    "crossed_paired_difference_reference",
    "paired_pooled_difference",
    "paired_pooled_difference_reference",
    "pooled",
    "prompt_totals",
    "resampled_ratios",
    "resampled_ratios_reference",
    "DraftTree",
    "build_tree",
    "build_tree_reference",
    "followed_depth",
    "followed_depth_reference",
    "TREE_SHAPES",
    "chain_tree",
    "chain_tree_reference",
    "graft_chain",
    "greedy_walk",
    "shaped_tree",
    "ExitLaw",
    "exit_law",
    "exit_law_reference",
    "Verdict",
    "VERIFIERS",
    "warp_probs",
    "sample_categorical",
    "verify_greedy",
    "verify_predraw",
    "verify_sequential",
    "verify_tev",
    "WEIGHT_TYPES",
    "block_cross_entropy",
    "block_cross_entropy_reference",
    "exit_node_loss",
    "exit_node_loss_reference",
    "mix_soft_labels",
    "sample_vocabulary",
    "sampled_block_cross_entropy",
    "sampled_block_cross_entropy_reference",
    "check_ngrams",
    "mix_copy",
    "mix_copy_reference",
    "ngram_lookup",
    "ngram_lookup_reference",
    "anchor_generator",
    "sample_anchors",
    "sample_anchors_reference",
    "select_trees",
    "tree_metrics",
    "tree_metrics_reference",
]
