"""The one Hydra entry point (see exittrain/__main__.py for the command word).

The command's config name (``--config-name=fit``) picks its library function from
:data:`COMMANDS`: ``fit`` -> :func:`exittrain.fit.fit`, ``eval`` ->
:func:`exittrain.evaluate.run_eval`, ``prepare`` -> :func:`exittrain.prepare.run_prepare`. The
recipes are registered as the ``recipe`` group (:func:`exittrain.configs.register_recipes`) before
Hydra starts, so ``+recipe=code`` works exactly as typed. Every output goes to Hydra's run
directory. Nothing in the package imports this module.

The CPU decode lab (:mod:`exittrain.cpu_decode`) is bound here and only when asked for: a ``fit``
or ``eval`` whose config says ``eval.decode=auto`` gets ``lab=``
:class:`~exittrain.cpu_decode.decode_lab.DecodeLab` (:func:`lab_arguments`); the runs themselves
never import it.
"""

from __future__ import annotations

import importlib
import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from exittrain.configs import CONF_DIR, register_recipes
from exittrain.host_memory import keep_freed_host_memory

# command (= primary config name in conf/) -> "module:function" taking the composed config
COMMANDS = {
    "fit": "exittrain.fit:fit",
    "eval": "exittrain.evaluate:run_eval",
    "prepare": "exittrain.prepare:run_prepare",
}


# the commands whose run takes the CPU decode lab when their config asks for eval.decode=auto
LAB_COMMANDS = ("fit", "eval")


def lab_arguments(command: str, cfg: DictConfig) -> dict:
    """``{"lab": DecodeLab()}`` for a ``fit`` or ``eval`` whose config asks for ``eval.decode=auto``,
    else ``{}``; :mod:`exittrain.cpu_decode` is imported only in the first case."""
    if command not in LAB_COMMANDS or OmegaConf.select(cfg, "eval.decode") != "auto":
        return {}
    from exittrain.cpu_decode.decode_lab import DecodeLab

    return {"lab": DecodeLab()}


def run_command(command: str, cfg: DictConfig):
    """Call the library function of ``command`` on ``cfg`` (with :func:`lab_arguments`); ValueError for
    an unknown command."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command config {command!r}; use one of {sorted(COMMANDS)}")
    module, name = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), name)(cfg, **lab_arguments(command, cfg))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=None)
def _hydra_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keep_freed_host_memory()  # CPU steps reuse their freed activations instead of faulting in new pages
    run_command(HydraConfig.get().job.config_name, cfg)


def hydra_entry() -> None:
    register_recipes()
    _hydra_main()
