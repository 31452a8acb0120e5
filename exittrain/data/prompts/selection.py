"""Which training prompts a run uses: a seeded sample, another seed's tasks left out, the validation split.

Prompts that pose the same task (the description and the stub of one CodeI/O row) share a task
key (:meth:`exittrain.data.prompts.prompt_sets.DomainPrompts.train_tasks`); the functions here keep such
prompts together, so that no held-out or "never seen" prompt has a twin on the other side.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

__all__ = ["sampled_tasks", "seeded_sample", "split_by_task", "unseen_tasks"]


def seeded_sample(n: int, k: int | None, seed: int) -> list[int]:
    """The sorted indices of ``k`` of ``n`` items drawn under ``seed``; all of them when ``k`` is None or >= n."""
    if k is None or n <= k:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), k))


def sampled_tasks(tasks: Sequence[str], k: int | None, seed: int) -> set[str]:
    """The task keys of the :func:`seeded_sample` of ``k`` of the prompts whose keys are ``tasks``: every task
    a run that sampled ``k`` prompts with ``seed`` saw (in some form)."""
    return {tasks[i] for i in seeded_sample(len(tasks), k, seed)}


def unseen_tasks(prompts: Sequence[str], tasks: Sequence[str], k: int | None, seed: int) -> list[str]:
    """``prompts`` without every task of the :func:`seeded_sample` of ``k`` that ``seed`` draws from them:
    the prompts a run that sampled with ``seed`` never saw, in any of a task's forms."""
    seen = sampled_tasks(tasks, k, seed)
    return [p for p, t in zip(prompts, tasks, strict=True) if t not in seen]


def split_by_task(order: Sequence[int], tasks: Sequence[str], n_val: int) -> tuple[list[int], list[int]]:
    """Hold out about ``n_val`` rows, whole tasks at a time: returns ``(val rows, train rows)``.

    ``order`` is the shuffled row list and ``tasks[i]`` the task key of row i
    (:meth:`DomainPrompts.train_tasks`). Tasks are taken in the order their first row appears in
    ``order`` until ``n_val`` rows are held out, so the last task may add a row or two more; no task
    has rows on both sides (the description and the stub of one CodeI/O task answer alike, and a
    validation row whose twin is trained on reads optimistic). With every task a single row this is
    ``order[:n_val]``, ``order[n_val:]``. Both lists keep the order of ``order``.
    """
    held: set[str] = set()
    count = Counter(tasks[i] for i in order)
    n = 0
    for i in order:
        if n >= n_val:
            break
        if tasks[i] not in held:
            held.add(tasks[i])
            n += count[tasks[i]]
    val = [i for i in order if tasks[i] in held]
    train = [i for i in order if tasks[i] not in held]
    return val, train
