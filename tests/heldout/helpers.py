"""A drafter briefly fitted on a tiny target's own answers, which the walks' and the pooled tau's tests share."""

from __future__ import annotations

import torch


def trained_drafter(target, prompts, answers, *, new_tokens: int, copy_ngrams=(), steps: int = 80, seed: int = 0,
                    layer_ids=None):
    """A drafter (block 5, one layer) fitted for ``steps`` AdamW steps on the target's greedy ``answers`` to
    ``prompts`` (``new_tokens`` each at most), so its rounds accept up to the whole chain: more steps,
    more acceptance."""
    from exittrain.core import block_cross_entropy
    from exittrain.models import new_drafter

    drafter = new_drafter(target, block_size=5, num_layers=1, seed=seed, copy_ngrams=list(copy_ngrams),
                          layer_ids=layer_ids)
    K = drafter.config.num_draft_tokens
    seqs = [p + y for p, y in zip(prompts, answers, strict=True)]
    T = max(map(len, seqs)) + K
    ids = torch.tensor([s + [1] * (T - len(s)) for s in seqs])
    features = target.sequence_features(ids, drafter.config.target_layer_ids).float()
    anchors = torch.stack([torch.arange(len(p) - 1, len(p) + new_tokens - 3) for p in prompts])
    labels = torch.stack([ids.gather(1, anchors + k) for k in range(1, K + 1)], -1).reshape(-1, K)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = block_cross_entropy(drafter.forward_anchors(features, ids, anchors), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()
