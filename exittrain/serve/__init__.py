"""Serving checks: an exittrain drafter in DFlash format, served by vLLM next to our own decoder.

- :mod:`exittrain.serve.check`: ``python -m exittrain.serve.check`` (``make serve-check``), the
  orchestrator, run in exittrain's venv.
- :mod:`exittrain.serve.vllm_run`: vLLM's decoding with and without a DFlash drafter, each in a fresh
  worker process (what the check, fit's finish and ``bench vllm`` call).
- :mod:`exittrain.serve.vllm_worker`: the script the orchestrator runs under ``.venv-vllm``'s
  interpreter (standard library and vLLM only).
- :mod:`exittrain.serve.compare`: parsing vLLM's metrics, comparing outputs, the table.
- :mod:`exittrain.serve.dflash_reference`: DFlash-format folders through the ``dflash`` package.

Nothing here is imported by ``import exittrain``; the package imports no vLLM.
"""
