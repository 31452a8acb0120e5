"""Sharded training of the drafter (FSDP2) on Lightning's ``ModelParallelStrategy``.

What is sharded: the drafter's parameters, gradients and AdamW states, over every rank. The frozen
target is a plain attribute of :class:`~exittrain.lit.ExitTrainModule`, not a submodule, so it is
never sharded: each rank keeps its own copy, as under DDP.

How (lightning 2.6, torch 2.13; read in ``lightning/pytorch/strategies/model_parallel.py`` and
``torch/distributed/fsdp/_fully_shard``):

- :class:`DrafterFSDPStrategy` is ``ModelParallelStrategy`` with a one-dimensional layout: every
  rank in the ``data_parallel`` dimension of the device mesh, ``tensor_parallel`` of size 1. It
  creates the process group (NCCL on GPUs, gloo on CPUs) and the mesh, and Lightning splits the
  data over that dimension. Unlike ``FSDPStrategy`` (FSDP1), Lightning accepts it on CPUs.
- ``ExitTrainModule.configure_model`` calls :func:`shard_drafter`: ``fully_shard`` on each
  ``DrafterLayer``, then on the drafter root (the context projection, norms, mask embedding and
  projections). Parameters become ``DTensor``s sharded on dim 0; each keeps its logical shape,
  so ``configure_optimizers``' matrices-only weight-decay split and norm-based gradient clipping
  see the real tensors. The training entry point ``forward_anchors`` is registered as an FSDP
  forward method, so it all-gathers like ``forward``.
- Outside a training forward the parameters are shards: :func:`full_drafter` gathers them
  (a collective every rank must enter) into a plain ``BlockDrafter`` on global rank 0, which
  decodes or saves it. Without sharding it returns the drafter itself at no cost.
- Checkpoints are single files holding the full state (``save_distributed_checkpoint=False``):
  Lightning gathers it on every rank and global rank 0 writes it, through the trainer's
  ``CheckpointIO``. ``ExitTrainModule.drafter_from_checkpoint``, ``fit ckpt_path=...`` and
  Lightning's resume (which scatters the full state back into the shards) read it unchanged.
- Precision: ``ModelParallelStrategy`` takes only :data:`exittrain.precision.SHARDED_PRECISIONS`
  (no ``16-mixed``); :func:`is_model_parallel` tells ``trainer.precision: auto`` and the config
  checks when that applies.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from exittrain.models import BlockDrafter, TargetModel

__all__ = ["DrafterFSDPStrategy", "drafter_and_target", "full_drafter", "is_model_parallel", "is_sharded",
           "shard_drafter"]

# FSDP2 warns once per process that the drafter's output is a view (forward_anchors returns a
# reshape): an in-place op on it would skip the pre-backward all-gather. ExitTrainModule never
# modifies the drafter's output in place (it indexes, log-softmaxes and reduces it), and
# tests/lit/test_fsdp.py checks every gradient against a single-process run.
_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPBlockDrafter\) returned a view tensor"


class DrafterFSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as plain FSDP: all ranks shard the drafter and split the data.

    ``ModelParallelStrategy``'s defaults build a (num_nodes, devices per node) mesh of data x tensor
    parallelism, which on one node would neither split the data nor shard over its devices. Here
    ``tensor_parallel_size`` is 1 and ``data_parallel_size`` the world size (devices x nodes,
    known once the trainer has resolved ``devices: -1``). Everything else is Lightning's: the
    launcher, the process group, the sampler, and full single-file checkpoints.

    Args:
        save_distributed_checkpoint: must stay False. True would write a folder of per-rank shards,
            which ``ExitTrainModule.drafter_from_checkpoint``, ``ExportDrafterCallback(export_best=True)``
            and ``fit ckpt_path=...`` cannot read.
        process_group_backend: None picks NCCL on GPUs and gloo on CPUs.
        timeout: of the process group's collectives.
    """

    def __init__(
        self,
        *,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if save_distributed_checkpoint:
            raise ValueError(
                "trainer.strategy.save_distributed_checkpoint=True writes a folder of per-rank shards, which "
                "ExitTrainModule.drafter_from_checkpoint and `fit ckpt_path=...` cannot read; set it to false "
                "(rank 0 then writes the whole drafter and its optimizer state into one file)"
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        # parallel_devices and num_nodes are set by the trainer by now; the mesh is built in super()
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


def is_model_parallel(strategy: Any) -> bool:
    """True when ``strategy`` is Lightning's ``ModelParallelStrategy`` or a subclass (``trainer=fsdp``'s
    :class:`DrafterFSDPStrategy`): the strategy that refuses ``16-mixed``.

    ``strategy`` is a ``trainer.strategy`` value as a config holds it (None, a registered name such
    as ``"ddp"``, a mapping with a ``_target_``, which is imported but not built) or as a Trainer
    receives it (a ``Strategy``). A ``_target_`` that cannot be imported raises Hydra's error.
    """
    if isinstance(strategy, Strategy):
        return isinstance(strategy, ModelParallelStrategy)
    if isinstance(strategy, str):
        cls = StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    elif isinstance(strategy, Mapping) and "_target_" in strategy:  # a DictConfig too
        from hydra.utils import get_class

        cls = get_class(str(strategy["_target_"]))
    else:
        cls = None
    return isinstance(cls, type) and issubclass(cls, ModelParallelStrategy)


def is_sharded(module: nn.Module) -> bool:
    """True when ``fully_shard`` (FSDP2) has been applied to ``module`` itself."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_drafter(drafter: BlockDrafter, mesh: DeviceMesh) -> bool:
    """Shard ``drafter`` in place over the 1-D ``mesh``: each layer, then the root. Idempotent.

    Returns True if it sharded now, False if ``drafter`` was already sharded (e.g. by an earlier
    stage's fit in the same processes; it then stays on the mesh it was sharded on, which covers
    the same ranks). Parameters keep their dtype and device; ``forward`` and ``forward_anchors``
    all-gather the parameters they need, so every rank must call them together.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if is_sharded(drafter):
        return False
    if mesh.ndim != 1:
        raise ValueError(f"shard_drafter needs a 1-D device mesh, got {mesh.ndim} dimensions {mesh.mesh_dim_names}")
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(drafter, mesh=mesh)
    register_fsdp_forward_method(drafter, "forward_anchors")
    warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
    return True


def full_drafter(drafter: BlockDrafter, target: TargetModel) -> BlockDrafter | None:
    """The drafter with all its parameters, for use outside a training forward (decoding, saving).

    Not sharded (one process, DDP): returns ``drafter`` itself; no copy, no communication.

    Sharded (:func:`shard_drafter`): a collective, so every rank must call it at the same point.
    The full parameters are gathered into CPU memory of global rank 0 only; there the function
    returns a new, plain :class:`~exittrain.models.BlockDrafter` holding them (same config,
    dtype and training mode), attached to ``target`` and on ``target.device``; every other rank
    gets None. The copy is a snapshot: training the sharded drafter does not change it.
    """
    if not is_sharded(drafter):
        return drafter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from exittrain.models import BlockDrafter

    # full_state_dict all-gathers every DTensor on all ranks; cpu_offload keeps the result on rank 0 only
    state = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    config = type(drafter.config).from_dict(drafter.config.to_dict())
    with torch.device("meta"):  # no initialisation: every tensor comes from the gathered state
        copy = BlockDrafter(config)
    copy.load_state_dict(state, strict=True, assign=True)
    copy.attach_target(target, check_name=False)  # the pairing was checked when ``drafter`` was attached
    return copy.to(target.device).train(drafter.training)


def drafter_and_target(pl_module):
    """The ``drafter`` and frozen ``target`` of an :class:`~exittrain.lit.ExitTrainModule`, for the callbacks;
    ValueError for a module without them."""
    drafter, target = getattr(pl_module, "drafter", None), getattr(pl_module, "target", None)
    if drafter is None or target is None:
        raise ValueError(
            f"{type(pl_module).__name__} has no 'drafter' and 'target' attributes; "
            "use these callbacks with ExitTrainModule"
        )
    return drafter, target
