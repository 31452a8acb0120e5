"""`python -m exittrain plan +recipe=code [overrides] [--device-memory 80GiB] [--json PATH]`: memory and
time of a ``fit`` run, per rank, before it starts.

The command line of :func:`exittrain.plan.make_plan`; the package's docstring says what it counts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from exittrain.plan.planner import make_plan
from exittrain.plan.result import Plan


def main(argv: list[str] | None = None) -> Plan:
    """``python -m exittrain plan [overrides] [--device-memory SIZE] [--json PATH]``: print the plan."""
    parser = argparse.ArgumentParser(
        prog="python -m exittrain plan", description=__doc__.split("\n\n")[0],
        epilog="overrides: exactly those of `python -m exittrain fit`, e.g. +recipe=code target=qwen3_8b trainer=ddp",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="fit overrides (key=value, +recipe=NAME, group=option)")
    parser.add_argument("--device-memory", default=None, help="one device's memory, e.g. 80GiB or 24GiB")
    parser.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        plan = make_plan(args.overrides, device_memory=args.device_memory)
    except ValueError as e:
        parser.exit(2, f"plan: {e}\n")
    print(plan.to_markdown())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=2, default=str) + "\n")
    return plan


if __name__ == "__main__":
    main()
