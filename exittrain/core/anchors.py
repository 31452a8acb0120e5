"""Anchor sampling: where in a batch of sequences the drafter's blocks start.

Shape legend: L sequences, T sequence length, A anchors per sequence, K drafter horizon.

An anchor a of sequence l is a position whose K labels ``x_{a+1..a+K}`` lie inside the sequence
and inside the loss mask; the root ``x_a`` itself need not be in the mask (it may be the last
prompt token). Sampling is reproducible: the generator is seeded from ``(seed, step, rank,
stream)`` (:func:`anchor_generator`), so a resumed run and every rank draw what an uninterrupted
run would, and the draw runs on the CPU, independent of the device.
"""

from __future__ import annotations

import torch

__all__ = ["anchor_generator", "sample_anchors", "sample_anchors_reference"]


def anchor_generator(seed: int, step: int, rank: int = 0, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, rank, stream)``; stream 0 = train, 1 = validation."""
    mixed = (int(seed) * 1_000_003 + int(step)) * 1_009 + int(rank) * 7 + int(stream)
    return torch.Generator(device="cpu").manual_seed(mixed % (2**63 - 1))


def _candidates(loss_mask_LT: torch.Tensor, lengths_L: torch.Tensor | None, horizon: int) -> torch.Tensor:
    """(L, T) bool on the CPU: positions a with ``a + K < length`` whose labels a+1..a+K are all masked."""
    mask = loss_mask_LT.detach().to("cpu", torch.bool)
    L, T = mask.shape
    if lengths_L is not None:
        mask &= torch.arange(T).unsqueeze(0) < lengths_L.detach().to("cpu").view(L, 1)
    # count of masked labels in a+1..a+K via a cumulative sum: cs[j] = mask[:, :j].sum()
    cs = torch.nn.functional.pad(mask.long().cumsum(1), (1, 0))  # (L, T+1)
    cand = torch.zeros(L, T, dtype=torch.bool)
    if T > horizon:
        a = torch.arange(T - horizon)
        cand[:, : T - horizon] = (cs[:, a + horizon + 1] - cs[:, a + 1]) == horizon
    return cand


def sample_anchors(
    loss_mask_LT: torch.Tensor,
    lengths_L: torch.Tensor | None,
    num_anchors: int,
    horizon: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``num_anchors`` A anchor positions per sequence without replacement.

    Candidates of sequence l: positions a with ``a + K < lengths[l]`` (K = ``horizon``) whose label
    positions ``a+1..a+K`` are all in ``loss_mask_LT`` (the root ``x_a`` itself need not be).
    Returns ``(anchors_LA long, valid_LA bool)`` on the mask's device. A sequence with c < A
    candidates fills slots c..A-1 with repeats of its own candidates (valid False); with c = 0
    every slot is position 0 and invalid. Sampling runs on the CPU with ``generator`` (one
    uniform key per position), so the result does not depend on the device.
    """
    if loss_mask_LT.dim() != 2:
        raise ValueError(f"loss_mask must be (L, T), got {tuple(loss_mask_LT.shape)}")
    device = loss_mask_LT.device
    cand = _candidates(loss_mask_LT, lengths_L, horizon)
    L, T = cand.shape
    keys = torch.rand(L, T, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
    order = torch.argsort(keys, dim=1, descending=True, stable=True)  # candidates first, random order
    count = cand.sum(1, keepdim=True)  # (L, 1)
    slot = torch.arange(num_anchors).unsqueeze(0)  # (1, A)
    anchors = order.gather(1, slot % count.clamp_min(1))  # repeats wrap around the candidates
    valid = slot < count
    anchors = torch.where(count > 0, anchors, torch.zeros_like(anchors))
    return anchors.to(device), valid.to(device)


def sample_anchors_reference(
    loss_mask_LT: torch.Tensor,
    lengths_L: torch.Tensor | None,
    num_anchors: int,
    horizon: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop twin of :func:`sample_anchors`: the same keys, candidates found position by position."""
    mask = loss_mask_LT.detach().to("cpu", torch.bool)
    L, T = mask.shape
    keys = torch.rand(L, T, generator=generator)
    anchors = torch.zeros(L, num_anchors, dtype=torch.long)
    valid = torch.zeros(L, num_anchors, dtype=torch.bool)
    for l in range(L):
        n = T if lengths_L is None else int(lengths_L[l])
        cand = [a for a in range(T) if a + horizon < n and all(bool(mask[l, a + j]) for j in range(1, horizon + 1))]
        # descending key, ties by position (argsort's stable order)
        cand.sort(key=lambda a: (-float(keys[l, a]), a))
        for s in range(num_anchors):
            if cand:
                anchors[l, s] = cand[s % len(cand)]
                valid[l, s] = s < len(cand)
    return anchors.to(loss_mask_LT.device), valid.to(loss_mask_LT.device)
