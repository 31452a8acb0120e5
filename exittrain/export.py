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

__all__ = ["export_beside", "main"]

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
    from exittrain.models.dflash_format import export_dflash

    try:
        report = export_dflash(args.drafter, args.out, mask_token_id=args.mask_token_id, dtype=args.dtype)
    except ValueError as e:
        parser.exit(2, f"export: {e}\n")
    dropped = "; dropped: " + ", ".join(report["dropped"]) if report["dropped"] else ""
    print(f"wrote {args.format} drafter {report['out']} ({', '.join(report['files'])}){dropped}")
    return report


def export_beside(drafter, run_dir) -> dict:
    """What ``fit`` calls after saving ``RUN_DIR/drafter``: the DFlash export to ``RUN_DIR/drafter_dflash``.

    Returns ``{"path", "dropped"}``; when the drafter has a setting the format cannot express,
    nothing is written, a warning says why and how to export once fixed, and the result is
    ``{"path": None, "why": message}`` (the run itself does not fail over it).
    """
    from pathlib import Path

    from exittrain.models.dflash_format import export_dflash

    run_dir = Path(run_dir)
    try:
        report = export_dflash(drafter, run_dir / "drafter_dflash")
    except ValueError as e:
        logger.warning(
            "no drafter_dflash/ written: %s. Once fixed: python -m exittrain export %s OUT --format dflash",
            e, run_dir / "drafter",
        )
        return {"path": None, "why": str(e)}
    return {"path": report["out"], "dropped": report["dropped"]}
