"""Slow reference twins of the training objective (exittrain.objective), built from core's loop twins.

Each takes ``(drafter, target, settings)``: ``settings`` is an :class:`~exittrain.objective.ObjectiveSettings`
or a module's ``hparams`` (the same fields).
"""

from __future__ import annotations

import torch

from exittrain.core import (
    block_cross_entropy_reference,
    build_tree,
    exit_law,
    exit_node_loss_reference,
    followed_depth_reference,
    mix_soft_labels,
    sample_anchors_reference,
    select_trees,
)


def reference_losses(drafter, target, settings, batch, generator):
    """``(L_tok, L_exit, analytic tau, greedy block length)`` recomputed step by step with the loop twins of core."""
    hp = settings
    K = drafter.config.num_draft_tokens
    ids = batch["input_ids"]
    features = target.sequence_features(ids, drafter.config.target_layer_ids).float()
    if hp.feature_cache:  # the objective's features are bf16-rounded with feature_cache, as the store keeps them
        features = features.bfloat16().float()
    anchors, valid = sample_anchors_reference(batch["loss_mask"], batch["lengths"], hp.anchors_per_seq, K, generator)
    logits = drafter.forward_anchors(features, ids, anchors)
    ce, n = 0.0, 0
    for l in range(anchors.shape[0]):
        for a in range(anchors.shape[1]):
            if valid[l, a]:
                row = logits[l * anchors.shape[1] + a].log_softmax(-1)
                pos = int(anchors[l, a])
                ce -= sum(float(row[k, ids[l, pos + 1 + k]]) for k in range(K))
                n += K
    trees = build_tree(logits.detach().log_softmax(-1), hp.budget)
    scores = target.score_trees(ids, anchors, trees).logits
    probs = scores.softmax(-1)
    T = hp.law_temperature  # the law the node loss reads: one-hot argmax at 0, else softmax(logits / T)
    law_probs = torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float() if T == 0 else (
        scores / T).softmax(-1)
    index = valid.reshape(-1).nonzero().squeeze(1)
    sub = select_trees(trees, index)
    alpha = 0.0 if hp.weight_type == "missing" else hp.alpha
    law = exit_law(sub, law_probs[index], alpha)
    exit_loss = exit_node_loss_reference(logits[index], sub, law, hp.weight_type, law_probs[index])
    A = anchors.shape[1]
    labels = torch.stack([ids[l, int(anchors[l, a]) + 1 : int(anchors[l, a]) + 1 + K] for l, a in
                          (divmod(int(i), A) for i in index)])  # (n, K) the rows' own next tokens
    greedy = 1.0 + followed_depth_reference(sub, labels).float().mean()
    return ce / n, float(exit_loss), exit_law(sub, probs[index]).expected_block_length.mean(), float(greedy)


def reference_soft_block_ce(drafter, target, settings, batch, generator, weight):
    """The block CE with soft labels, from a plain forward's distributions and the loop twin of core."""
    hp = settings
    K = drafter.config.num_draft_tokens
    ids = batch["input_ids"]
    features = target.sequence_features(ids, drafter.config.target_layer_ids).float()
    if hp.feature_cache:
        features = features.bfloat16().float()
    anchors, valid = sample_anchors_reference(batch["loss_mask"], batch["lengths"], hp.anchors_per_seq, K, generator)
    logits = drafter.forward_anchors(features, ids, anchors)
    L, A = anchors.shape
    labels = torch.zeros(L * A, K, dtype=torch.long)
    top_ids = torch.zeros(L * A, K, hp.soft_label_top_k, dtype=torch.long)
    top_logp = torch.zeros(L * A, K, hp.soft_label_top_k)
    for l in range(L):
        n = int(batch["lengths"][l])
        with torch.no_grad():
            logp = target.model(input_ids=ids[l : l + 1, :n]).logits[0].float().log_softmax(-1)  # (n, V)
        for a in range(A):
            for k in range(K):
                p = min(int(anchors[l, a]) + 1 + k, ids.shape[1] - 1)  # label position (clamped like the objective)
                labels[l * A + a, k] = ids[l, p]
                if p - 1 < n - 1:
                    top_logp[l * A + a, k], top_ids[l * A + a, k] = logp[p - 1].topk(hp.soft_label_top_k)
    soft_ids, probs = mix_soft_labels(labels, top_ids, top_logp, weight)
    mask = valid.reshape(-1, 1).expand(-1, K)
    ce = block_cross_entropy_reference(logits, soft_ids, label_mask=mask, label_probs=probs, gamma=hp.gamma)
    return float(ce.detach())
