"""What makes a decode fast on a CPU, off the training path: the ``decode: auto`` probe of this
host's fastest setting (budget, draft vocabulary, copy-led rounds, steps after a miss), the
rounds that skip the drafter (copy-led rounds and steps after a miss, ``round_policy``), the
linears packed for MKL, the LM head's row layouts, and the draft vocabulary.

Training, the data step, the objective and the plain decoder never import it (the layer test,
tests/test_architecture.py); ``eval.decode=auto`` and the CPU benches do. Its guide: docs/cpu_decoding.md.
"""
