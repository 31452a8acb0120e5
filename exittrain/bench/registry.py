"""`python -m exittrain bench NAME [args]`: run one benchmark (NAME: a key of :data:`BENCHES`)."""

from __future__ import annotations

import importlib
import logging
import sys

from exittrain.host_memory import keep_freed_host_memory

BENCHES = {
    "core": "exittrain.bench.core",
    "decode": "exittrain.bench.decode",
    "copy": "exittrain.bench.copy_chains",
    "rows": "exittrain.bench.row_cost",
    "train": "exittrain.bench.train",
    "memory": "exittrain.bench.scoring_memory",
    "regen": "exittrain.bench.regen",
    "exittrain": "exittrain.bench.exittrain_arms",
    "curve": "exittrain.bench.curve",
    "vllm": "exittrain.bench.vllm_acceptance",
    "gpu": "exittrain.bench.gpu_check",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        sys.stderr.write(f"usage: python -m exittrain bench {{{','.join(BENCHES)}}} [--help]\n")
        raise SystemExit(2)
    keep_freed_host_memory()  # as fit and eval do: the benchmarks measure the same process settings
    # progress lines (exittrain.progress.Ticker) and the choices logged on the way go to stderr
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
