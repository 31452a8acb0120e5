"""``python -m exittrain export DRAFTER_DIR OUT --format dflash``: a saved drafter in a serving format.

Formats: ``dflash`` (:func:`exittrain.models.dflash_format.export_dflash`), read by the ``dflash``
package, vLLM (``--speculative-config '{"method": "dflash", "model": OUT, ...}'``) and SGLang
(``--speculative-algorithm DFLASH --speculative-draft-model-path OUT``). The n-gram copy branch
is dropped (and said so); settings the format cannot express are refused with the fix.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

__all__ = ["export_atomic", "export_beside", "main", "spare_token_id"]

FORMATS = ("dflash",)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m exittrain export", description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="a drafter folder saved by exittrain (RUN_DIR/drafter)")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--format", choices=FORMATS, default="dflash")
    parser.add_argument(
        "--mask-token-id", type=int, default=None,
        help="mask token id for a drafter with a learned mask and none set (a token the target never emits)",
    )
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the drafter's), e.g. bfloat16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = export_atomic(args.drafter, args.out, mask_token_id=args.mask_token_id, dtype=args.dtype)
    except (ValueError, OSError) as e:  # a bad drafter (ValueError), or a write that failed (WriteError)
        parser.exit(2, f"export: {e}\n")
    dropped = "; dropped: " + ", ".join(report["dropped"]) if report["dropped"] else ""
    print(f"wrote {args.format} drafter {report['out']} ({', '.join(report['files'])}){dropped}")
    return report


def spare_token_id(tokenizer, vocab_size: int, exclude) -> int | None:
    """A token id the target does not emit in practice, to name a learned mask embedding by.

    The first embedding row past the tokenizer's vocabulary when the model pads its vocabulary
    (no text encodes to it), else the highest-numbered added token that is not in ``exclude``
    (the target's end-of-sequence ids) nor the BOS or padding token; None when there is none.
    A serving engine swaps the mask embedding in wherever its input is this id, so a target
    that did emit it would draft worse after it, never decode other tokens.
    """
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    taken = {*exclude, tokenizer.bos_token_id, tokenizer.pad_token_id}
    added = [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in taken and 0 <= i < vocab_size]
    return max(added) if added else None


def export_beside(drafter, run_dir, target=None) -> dict:
    """What ``fit`` calls after saving ``RUN_DIR/drafter``: the DFlash export to ``RUN_DIR/drafter_dflash``.

    A learned mask embedding with no ``mask_token_id`` is shipped under :func:`spare_token_id` of
    ``target``'s tokenizer (logged). Returns ``{"path", "dropped", "mask_token_id"}``; when the
    drafter has a setting the format cannot express, nothing is written, a warning says why and
    how to export once fixed, and the result is ``{"path": None, "why": message}`` (the run itself
    does not fail over it).
    """
    from pathlib import Path

    run_dir = Path(run_dir)
    mask_id = None
    cfg = drafter.config
    if cfg.learned_mask and cfg.mask_token_id is None and target is not None and target.tokenizer is not None:
        mask_id = spare_token_id(target.tokenizer, cfg.target_vocab_size, target.eos_token_ids)
        if mask_id is not None:
            logger.info("drafter_dflash/: the learned mask embedding ships under token id %d (a token the "
                        "target does not emit); set drafter.mask_token_id to choose another", mask_id)
    try:
        report = export_atomic(drafter, run_dir / "drafter_dflash", mask_token_id=mask_id)
    except ValueError as e:
        logger.warning(
            "no drafter_dflash/ written: %s. Once fixed: python -m exittrain export %s OUT --format dflash",
            e, run_dir / "drafter",
        )
        return {"path": None, "why": str(e)}
    return {"path": report["out"], "dropped": report["dropped"], "mask_token_id": mask_id}


def export_atomic(drafter, out, **kwargs) -> dict:
    """:func:`exittrain.models.dflash_format.export_dflash` (``kwargs``: its settings) into a temporary
    sibling of ``out`` that then replaces ``out`` (:func:`exittrain.atomic.write_folder_atomic`): a
    failed or killed export leaves the previous folder, never a half-written one. A failure of the file
    system (a full disk) raises :class:`exittrain.atomic.WriteError` naming ``out`` and the fix; a
    drafter the format cannot express raises ValueError with nothing written."""
    from pathlib import Path

    from exittrain.atomic import write_folder_atomic
    from exittrain.models.dflash_format import export_dflash

    fix = (
        "write it to a disk with room: python -m exittrain export DRAFTER_DIR OUT --format dflash, with DRAFTER_DIR "
        "the drafter folder it was exported from (RUN_DIR/drafter)"
    )
    report = write_folder_atomic(out, lambda tmp: export_dflash(drafter, tmp, **kwargs), what="DFlash export", fix=fix)
    return {**report, "out": str(Path(out))}
