"""`python -m exittrain <command> [args]`.

Commands: ``fit`` (train a drafter, conf/fit.yaml), ``prepare`` (fit's data step alone, with
fit's config: conf/prepare.yaml), ``eval`` (decode held-out prompts, conf/eval.yaml), ``report``
(tables and plots from run directories), ``bench`` (benchmarks), ``export`` (a saved drafter in a
serving format, :mod:`exittrain.export`).

The Hydra commands (:data:`HYDRA_COMMANDS`) go through :mod:`exittrain.cli`. Hydra would read a
bare ``fit`` as an override, so the first word is rewritten into ``--config-name=fit`` before
Hydra starts; Lightning's DDP relaunch re-enters with that form. For ``eval``, ``drafter=PATH``
is rewritten into ``drafter_path=PATH``: conf/drafter/ is a config group (fit's drafter
architecture), so Hydra would read ``drafter=...`` as a group choice. The other commands
(:data:`PLAIN_COMMANDS`) take their own arguments: ``"module:function"``, called with the rest
of the command line.
"""

from __future__ import annotations

import importlib
import sys

from exittrain.bench.registry import BENCHES  # a dict of module names: imports nothing heavy

HYDRA_COMMANDS = ("fit", "prepare", "eval")
PLAIN_COMMANDS = {
    "report": "exittrain.report.run_report:main",
    "bench": "exittrain.bench.registry:main",
    "export": "exittrain.export:main",
    "plan": "exittrain.plan:main",
}
USAGE = f"""usage: python -m exittrain {{fit,prepare,eval,report,bench,export,plan}} [args]

  fit     train a drafter:         python -m exittrain fit +recipe=code [debug=smoke] [key=value ...]
  prepare fit's data step alone:   python -m exittrain prepare +recipe=code [data.generation.shard=I/N] [...]
  eval    decode held-out prompts: python -m exittrain eval +recipe=code drafter=RUN_DIR/drafter
  report  tables and plots:        python -m exittrain report RUN_DIR [RUN_DIR ...]
  bench   benchmarks:              python -m exittrain bench {{{",".join(BENCHES)}}} [--help]
  export  for serving engines:     python -m exittrain export RUN_DIR/drafter OUT --format dflash
  plan    memory and steps per rank: python -m exittrain plan +recipe=code [key=value ...] [--device-memory 80GiB]
"""


def _hydra_argv(argv: list[str]) -> list[str]:
    """The Hydra command line of ``<command> [overrides]``."""
    rest = [f"--config-name={argv[0]}", *argv[1:]]
    if argv[0] == "eval":
        rest = [("drafter_path=" + a.removeprefix("drafter=")) if a.startswith("drafter=") else a for a in rest]
    return rest


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--config-name"):  # a relaunched child process
        rest = argv
    elif argv and argv[0] in HYDRA_COMMANDS:
        rest = _hydra_argv(argv)
    elif argv and argv[0] in PLAIN_COMMANDS:
        module, name = PLAIN_COMMANDS[argv[0]].split(":")
        return getattr(importlib.import_module(module), name)(argv[1:])
    else:
        sys.stderr.write(USAGE)
        raise SystemExit(2 if argv and argv[0] not in ("-h", "--help") else 0)
    sys.argv = [sys.argv[0], *rest]
    from exittrain.cli import hydra_entry

    hydra_entry()


if __name__ == "__main__":
    main()
