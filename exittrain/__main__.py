"""`python -m exittrain <command> [hydra overrides]`.

Commands: ``fit`` (train a drafter, conf/fit.yaml), ``eval`` (decode held-out prompts,
conf/eval.yaml), ``report`` (tables and plots from run directories), ``bench`` (benchmarks),
``export`` (a saved drafter in a serving format, :mod:`exittrain.export`).
Hydra would read a bare ``fit`` as an override, so the first word is rewritten into
``--config-name=fit`` before Hydra starts; Lightning's DDP relaunch re-enters with that form.
For ``eval``, ``drafter=PATH`` is rewritten into ``drafter_path=PATH``: conf/drafter/ is a
config group (fit's drafter architecture), so Hydra would read ``drafter=...`` as a group choice.
"""

from __future__ import annotations

import sys

from exittrain.eval.bench import BENCHES  # a dict of module names: imports nothing heavy

HYDRA_COMMANDS = ("fit", "eval")
USAGE = f"""usage: python -m exittrain {{fit,eval,report,bench,export}} [args]

  fit     train a drafter:         python -m exittrain fit +recipe=code [debug=smoke] [key=value ...]
  eval    decode held-out prompts: python -m exittrain eval +recipe=code drafter=RUN_DIR/drafter
  report  tables and plots:        python -m exittrain report RUN_DIR [RUN_DIR ...]
  bench   benchmarks:              python -m exittrain bench {{{",".join(BENCHES)}}} [--help]
  export  for serving engines:     python -m exittrain export RUN_DIR/drafter OUT --format dflash
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--config-name"):  # a relaunched child process
        rest = argv
    elif argv and argv[0] in HYDRA_COMMANDS:
        rest = [f"--config-name={argv[0]}", *argv[1:]]
        if argv[0] == "eval":
            rest = [("drafter_path=" + a.removeprefix("drafter=")) if a.startswith("drafter=") else a for a in rest]
    elif argv and argv[0] == "report":
        from exittrain.eval.report import main as report_main

        return report_main(argv[1:])
    elif argv and argv[0] == "export":
        from exittrain.export import main as export_main

        return export_main(argv[1:])
    elif argv and argv[0] == "bench":
        from exittrain.eval.bench import main as bench_main

        return bench_main(argv[1:])
    else:
        sys.stderr.write(USAGE)
        raise SystemExit(2 if argv and argv[0] not in ("-h", "--help") else 0)
    sys.argv = [sys.argv[0], *rest]
    from exittrain.cli import hydra_entry

    hydra_entry()


if __name__ == "__main__":
    main()
