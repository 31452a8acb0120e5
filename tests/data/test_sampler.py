"""Where a resumed fit continues the training order (exittrain.data.sampler.resume_point)."""

from __future__ import annotations

import logging

from exittrain.data.sampler import resume_point

ORDER = {"epoch": 2, "batches_done": 3, "seed": 0, "batch_size": 2, "world_size": 1}


def test_the_same_order_continues_and_another_restarts_the_epoch(caplog):
    assert resume_point(ORDER, seed=0, batch_size=2, world_size=1) == (2, 3)
    with caplog.at_level(logging.WARNING, logger="exittrain.data.sampler"):
        assert resume_point(ORDER, seed=0, batch_size=4, world_size=1) == (2, 0)
    assert "differs from this run's" in caplog.text and "epoch 2 restarts from its first batch" in caplog.text
    assert resume_point({**ORDER, "world_size": 2}, seed=0, batch_size=2, world_size=1) == (2, 0)
