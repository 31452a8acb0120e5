"""`python -m exittrain bench {core,decode,train,ablation} [args]`: dispatch to one benchmark."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "core": "exittrain.eval.bench_core",
    "decode": "exittrain.eval.bench_decode",
    "train": "exittrain.eval.bench_train",
    "ablation": "exittrain.eval.bench_ablation",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        sys.stderr.write(f"usage: python -m exittrain bench {{{','.join(BENCHES)}}} [--help]\n")
        raise SystemExit(2)
    importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
