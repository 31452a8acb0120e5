"""`python -m exittrain plan +recipe=code [overrides] [--device-memory 80GiB] [--json PATH]`: memory and
time of a ``fit`` run, per rank, before it starts.

The input is the config ``fit`` would compose from the same overrides (conf/fit.yaml, the recipes
registered as ``+recipe=NAME``), checked by :func:`exittrain.settings.check_fit_config`. The target
is read from its ``config.json`` only (the embedded SmolLM2, a local folder, or a hub id already in
the hub cache; never the network) and built on the ``meta`` device with the drafter, so the
parameter counts are the real modules' and no weight is read or allocated. A hub id whose
``config.json`` is not cached falls back to :data:`KNOWN_CONFIGS` (the published values of a few
targets, cited there), and a ``warm_start`` DFlash drafter to :data:`KNOWN_DFLASH`; the plan says so.

What it counts, per rank, in bytes (each :class:`Item` carries its formula):

- the frozen target's weights at the dtype the run loads it in (``target.dtype``; ``auto`` as
  :mod:`exittrain.precision` resolves it on the run's device: measured here for a CPU run, bf16
  for a GPU run on a host without CUDA; the bf16 figure is given too). ``trainer.precision=auto``
  likewise;
- the drafter's parameters, gradients and AdamW moments at its parameter dtype (fp32 under
  ``32-true``, ``bf16-mixed`` and ``16-mixed``, bf16 under ``bf16-true``), autocast's bf16 copies of
  its weights under mixed precision, DDP's gradient buckets, or FSDP's shards (``trainer=fsdp``);
- every step kind the stages run (a training step and a validation step per stage, and the
  regeneration on rank 0: the target, its copy in the generation dtype, the answering batch's
  K/V), each as a sequence of phases (target features, drafter forward, tree
  scoring, target probabilities, node loss, backward) with what is alive in each; the step's peak
  is its largest phase. The big terms are exact shapes: tree scoring's logits
  N x (B + 1) x V (N = batch_size x anchors_per_seq) and, chunked by ``tree.score_chunk_size``,
  one chunk's L x c x (B + 1) x V; the causal prefix's K/V (layers x 2 x L x T x kv_heads x
  head_dim) and the prefix plus one chunk's K/V; the drafter's N x K x V log-probabilities and
  the copies the losses keep for backward (counted from exittrain/objective.py and
  exittrain/core/losses.py); one layer's K/V repeated to every query head (transformers repeats
  grouped-query K/V under a mask). The activations of one target layer (calibrated on SmolLM2's
  decoder on a CPU) and of the drafter's layers are estimates, marked ``~`` in their formula.
- the data (host memory and disk): answer and row tokens, soft labels (top-k ids int32 and
  log-probabilities fp32 per response token) and target features (layers x hidden x tokens x 2
  bytes bf16), which ``objective.feature_cache=true`` holds in every process's host memory (on a
  CPU run that memory is the device's, and it is counted there);
- the schedule: training rows (at most: the regeneration drops prompts longer than
  ``data.generation.max_prompt_tokens``), steps per epoch per rank, tokens and anchors per step.

With a device memory (``--device-memory``, the GPU's own size where CUDA is visible, or the host's
memory for a CPU run) it says whether the run fits, with 10% left for what it cannot see, and
ranks the settings that lower the peak (each re-planned with its override, saving = the
difference of the two plans).

What it cannot see: the allocator's fragmentation and cached blocks, the CUDA context (0.5-1 GiB
per process; 1 GiB is added to a GPU's need), workspace and temporary buffers of attention and
matmul kernels (no attention score matrix is counted: a masked SDPA call keeps none on a CPU,
checked, nor with the memory-efficient kernels of a GPU), NCCL buffers, Python, torch and library
overhead (on a CPU this process's own resident size stands in for it), the DataLoader's workers
and pinned memory, and the decoding evaluations.
Activations are counted with every anchor valid and every row ``data.max_length`` long: an upper
bound of a real batch. The validation against measured peaks is in docs/multi_gpu.md.

Shape legend: L sequences per batch (``data.batch_size``), T = ``data.max_length``, A anchors per
sequence, N = L x A, K = block_size - 1, S = block_size, B the tree budget, c anchors per
scoring chunk, V vocabulary, H target width, I target MLP width, D drafter width, F feature width
(feature layers x H), W world size.
"""

from __future__ import annotations

from exittrain.plan.command import main
from exittrain.plan.memory import Item, Step, parse_size
from exittrain.plan.models import KNOWN_CONFIGS, KNOWN_DFLASH, compose_fit
from exittrain.plan.planner import make_plan
from exittrain.plan.result import Plan

__all__ = ["KNOWN_CONFIGS", "KNOWN_DFLASH", "Item", "Step", "Plan", "compose_fit", "make_plan", "parse_size", "main"]
