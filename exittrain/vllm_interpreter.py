"""Where vLLM's interpreter is: the one answer every vLLM caller uses (fit's finish, the serving
check, the vLLM benches, the regeneration's vLLM backend)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_vllm_python"]


def default_vllm_python() -> str:
    """``$EXITTRAIN_VLLM_PYTHON``, else the checkout's ``.venv-vllm/bin/python`` (``make
    vllm-setup``), found from this file so that neither the working directory nor Hydra's run
    directory matters. Not resolved: a venv's python is a symlink whose target loses the venv."""
    env = os.environ.get("EXITTRAIN_VLLM_PYTHON")
    return env or str(Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")
