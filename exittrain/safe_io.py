"""Reading the files a run is handed (checkpoints, saved drafters, cache tensors), with errors in our words.

Every loader here raises ``ValueError`` for a bad file, and the message always holds three parts:
the file (its path, with ``what`` saying which file it is to the run), what is wrong with it, and
``fix``: what the caller tells the user to do instead. The causes told apart:

- missing: no such path (or a folder where a file is expected);
- corrupt: truncated, empty, random bytes, not a zip / not safetensors / not JSON;
- refused (checkpoints only): a pickle naming a class or function that ``torch.load(weights_only=True)``
  does not allow. exittrain writes tensors and plain containers only, so such a file was written
  by something else or altered; loading it anyway would run whatever the pickle calls.

Why our words and not the library's: torch's refusal advises retrying with ``weights_only``
switched off, which for a malicious file *is* the exploit. That advice never reaches our
message, and the refusal is raised ``from None`` so the original text is not printed as the
traceback's context either. Other errors (a zip reader's complaint about a truncated file) are
chained ``from e``: their text is useful and holds no such advice (checked, not assumed).

What "whole file" means per format: :func:`load_checkpoint` unpickles the whole checkpoint and
reads every tensor, so a truncation anywhere fails here, before Lightning reads the file again.
Safetensors has a JSON header followed by raw bytes and no checksum: :func:`check_safetensors`
parses the header and checks that its tensors cover the file's bytes exactly (what safetensors
itself checks on open), which catches truncation and garbage; flipped bits inside tensor data
cannot be seen by any loader of this format.

Standard library, torch and safetensors only.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

__all__ = ["check_safetensors", "load_checkpoint", "load_json_object", "load_safetensors"]

# torch's UnpicklingError texts that mean "a well-formed pickle asked for something not allowed"
# (torch/_weights_only_unpickler.py); any other UnpicklingError is a damaged or foreign byte stream
_REFUSED = re.compile(r"GLOBAL \S+|unrecognized function|allowlisted|must be imported to load")
# the name a refused pickle asked for comes from the file itself: only a dotted identifier is echoed
_GLOBAL_NAME = re.compile(r"GLOBAL ([A-Za-z_][\w.]{0,199})(?=\s|$)")
# the library advice that must never be repeated to the user (see the module docstring)
_UNSAFE_ADVICE = "weights_only"


def _require_file(path: Path, what: str, fix: str) -> None:
    """ValueError when ``path`` does not exist or is a folder (our words instead of an Errno text)."""
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist: {fix}")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder, not a file: {fix}")


def _detail(e: BaseException) -> str:
    """A short, safe summary of a library error: its type and first sentence.

    The text is dropped (type only) when it mentions ``weights_only``, so no library advice to
    switch the safe load off can pass through; characters that are not printable (the text may
    quote bytes of the file) become ``?``.
    """
    text = str(e).strip()
    if not text or _UNSAFE_ADVICE in text:
        return type(e).__name__
    first = "".join(c if c.isprintable() else "?" for c in text.splitlines()[0].split(". ")[0].rstrip("."))
    if len(first) > 160:
        first = first[:157] + "..."
    return f"{type(e).__name__}: {first}"


def load_checkpoint(path: str | os.PathLike, *, what: str, fix: str, map_location: Any = "cpu") -> dict[str, Any]:
    """The dict saved in the checkpoint file ``path``, read with ``torch.load(weights_only=True)``.

    ``what`` names the file in messages (``"ckpt_path checkpoint"``), ``fix`` says what to do
    instead (a sentence fragment, appended). The whole file is read: every tensor is loaded onto
    ``map_location``. Raises ``ValueError`` naming ``path`` when it is missing or a folder, empty,
    corrupt or truncated, holds objects the safe load refuses (the names the pickle asked for are
    listed), or holds something other than a dict (a Lightning checkpoint is a dict). The message
    never suggests loading the file unsafely.
    """
    path = Path(path)
    _require_file(path, what, fix)
    if path.stat().st_size == 0:
        raise ValueError(f"{what} {path} is empty (0 bytes: an unfinished or failed write): {fix}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if _REFUSED.search(text):
            names = sorted({n for n in _GLOBAL_NAME.findall(text) if _UNSAFE_ADVICE not in n})
            asked = f" (it asks for {', '.join(names)})" if names else ""
            # from None: torch's text advises the unsafe retry; it must not be printed as context either
            raise ValueError(
                f"{what} {path} holds objects that a safe load refuses{asked}: checkpoints written by exittrain "
                "hold only tensors and plain containers, so this file was written by something else or altered. "
                f"Do not load it with an unsafe loader (unpickling it can run arbitrary code); {fix}"
            ) from None
        # from None as well: for a damaged pickle torch's text gives the same unsafe advice
        raise ValueError(
            f"{what} {path} is corrupt or not a PyTorch checkpoint (its pickle is unreadable): {fix}"
        ) from None
    except MemoryError:
        raise
    except Exception as e:
        # a damaged file surfaces as whatever the reader tripped on: RuntimeError (the zip reader),
        # OSError (a truncated zip), EOFError, KeyError, ValueError (the legacy format's pickles)
        message = f"{what} {path} is corrupt or truncated ({_detail(e)}): {fix}"
        if _UNSAFE_ADVICE in str(e):
            raise ValueError(message) from None
        raise ValueError(message) from e
    if not isinstance(ckpt, dict):
        raise ValueError(f"{what} {path} holds a {type(ckpt).__name__}, not a checkpoint dict: {fix}")
    return ckpt


def check_safetensors(path: str | os.PathLike, *, what: str, fix: str) -> list[str]:
    """The tensor names in the safetensors file ``path``, after checking the file is whole.

    Reads the header only (no tensor data): safetensors checks on open that the header parses
    and that the tensors it lists cover the file's bytes exactly, so a truncated, empty or random
    file fails. Raises ``ValueError`` naming ``path`` (missing, a folder, corrupt or truncated)
    with ``fix`` appended.
    """
    path = Path(path)
    _require_file(path, what, fix)
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{what} {path} is corrupt or truncated ({_detail(e)}): {fix}") from e


def load_safetensors(path: str | os.PathLike, *, what: str, fix: str) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file(path)`` (every tensor, on the CPU), with :func:`check_safetensors`'s errors."""
    path = Path(path)
    _require_file(path, what, fix)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{what} {path} is corrupt or truncated ({_detail(e)}): {fix}") from e


def load_json_object(path: str | os.PathLike, *, what: str, fix: str) -> dict[str, Any]:
    """The JSON object (a dict) in the UTF-8 file ``path``.

    Raises ``ValueError`` naming ``path`` when it is missing or a folder, not UTF-8, not valid
    JSON (with the line and column of the first error), or valid JSON that is not an object.
    """
    path = Path(path)
    _require_file(path, what, fix)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON ({e}; truncated or hand-edited?): {fix}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}): {fix}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value
