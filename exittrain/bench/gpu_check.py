"""The prepared GPU check at 8B shapes, and its CPU twin: ``python -m exittrain bench gpu [--tiny]
[--device cuda|cpu] [--targets qwen3_8b llama31_8b] [--budgets 16 32 64 128 256] [--repeats 3]
[--context 1024] [--out results/gpu_check]``

For each target (``--targets``: names of conf/target; each runs its ``+experiment=<name>_ddp`` preset
on one device: ``trainer=gpu trainer.devices=1``, ``trainer.precision=bf16-mixed``, the target in
bf16), with random weights built from the target's config (:func:`exittrain.plan.models.target_config`:
the hub cache's config.json, else the published values of ``KNOWN_CONFIGS``; no network, no
download) and a random drafter shaped like the DFlash drafter ``plan`` assumes for it
(``KNOWN_DFLASH``, applied through ``cfg.drafter``: the same parameter count as the plan's
``warm_start`` drafter), it measures:

1. **Training steps.** The block-CE step (stage ``pretrain``) and the ExitTrain step (stage
   ``exittrain``) at the preset's batch (L rows of T = ``data.max_length`` tokens), anchors (A) and
   budget (B). Each step drives the stage's module (built by :func:`exittrain.build.build_module`, as
   ``fit`` builds it) without a Lightning Trainer: ``training_step`` under bf16 autocast on a synthetic
   batch (random ids in :class:`exittrain.data.collate.Collator`'s layout, every row T tokens with a
   T // 16 prompt, plus the top-k soft labels the feature store adds), backward, gradient clipping at
   ``trainer.gradient_clip_val`` and an AdamW step. One untimed warm-up step (it also allocates the
   AdamW moments), then ``--repeats`` timed steps: the median time, and the peak memory over them
   against the plan's peak for the same step (:func:`exittrain.plan.make_plan` of the same overrides)
   as measured / planned. Goal: within +-15% (:data:`MEMORY_GOAL`).
2. **Tree scoring against a plain forward.** :meth:`TargetModel.score_trees` (exact, all anchors in
   one forward) over L sequences of T tokens with A trees of B nodes each, against one plain target
   forward over L sequences of T + A(B + 1) tokens keeping the logits of the last A(B + 1): the
   same rows through the decoder and the same logit rows. The trees are ``bench memory``'s
   (:func:`~exittrain.bench.scoring_memory.make_inputs`: random trees of depth 7 on one sequence,
   repeated to L; the cost follows the rows, not the depth). Goal: <= 1.3x (:data:`SCORING_GOAL`).
3. **Verifiers.** TEV's decision against the greedy and the sequential verifier on one tree
   (N = 1, a decoding round) of each budget of ``--budgets``, K = the drafter's horizon and V = the
   target's, the target logits in the target's dtype (TEV and sequential at temperature 1, greedy at
   0). Trees and logits come from :mod:`exittrain.bench.core`.
4. **Decode round against an autoregressive step.** One round of
   :class:`~exittrain.decoding.SpeculativeDecoder` (TEV, temperature 0: draft, tree, target forward
   over B + 1 rows, verify, commit) against one step of
   :func:`~exittrain.decoding.autoregressive_generate`, after a prompt of ``--context`` random tokens;
   the median of the rounds between the first and the last. round / step is the cost side of the
   speedup bound (speedup <= tau / (round / step)); the random drafter accepts next to nothing, so
   tau is not measured here. The drafter runs in fp32, as it trains.

Memory, what each side counts. Measured on CUDA: ``torch.cuda.max_memory_allocated`` over the timed
steps, the whole process's live tensors (target, drafter, AdamW state, batch, activations); neither
the CUDA context nor the allocator's cached blocks (``max_memory_reserved`` is reported beside it).
Planned: the step's largest phase, the persistent state included, without the 1 GiB the plan adds
for the CUDA context. The plan counts the drafter's gradients through the whole step, while they
exist only from backward on. On a CPU (the twin) memory is **not measured**: the resident size
counts the interpreter, torch and the data beside the step, which the plan does not.

A step the plan says does not fit the device (its peak plus the CUDA context above the capacity)
is skipped with the reason; a ``torch.cuda.OutOfMemoryError`` is recorded for its point, and so is
any other error (then the command exits 1 after writing the results); the check goes on either way.
Each target is loaded once and freed before the next.

Time budget by design: both 8B targets within 8 minutes on one H200 (each target is planned and
built once; each timed point is a warm-up and ``--repeats`` repeats); not yet timed on a GPU. ``--tiny`` is the
CPU twin: tiny random configs of both families (written to a temporary folder as config.json and
read by the plan from there), a short batch, the same code path; tens of seconds on 2 cores, run by
the slow test tier. Writes ``<out>.json`` and ``<out>.md``; progress lines go to stderr.

Shape legend: L sequences per batch, T = ``data.max_length``, A anchors per sequence, B budget,
K = block_size - 1, V vocabulary, Q = A(B + 1) tree rows per sequence, C decode context.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from exittrain.bench.core import agreeing_target_logits, drafter_logprobs
from exittrain.bench.decode import host, host_line
from exittrain.bench.row_cost import check_counts
from exittrain.bench.scoring_memory import TINY, make_inputs
from exittrain.plan.memory import human
from exittrain.tables import cell, markdown_table, write_results
from exittrain.timing import alternating_medians, device_now

log = logging.getLogger(__name__)

TARGETS = ("qwen3_8b", "llama31_8b")
"""conf/target names; each is checked at its ``+experiment=<name>_ddp`` preset."""
STEP_STAGES = ("pretrain", "exittrain")  # the block-CE step and the ExitTrain step
MEMORY_GOAL = (0.85, 1.15)  # measured / planned peak
SCORING_GOAL = (0.0, 1.3)  # score_trees / plain forward over the same rows
VERIFY_REPEATS = 10  # a verifier call takes milliseconds: more repeats cost nothing
DECODE_ROUNDS = 8

# the twin: tiny random targets of both families (bench memory's TINY with grouped-query heads), a
# drafter of the same layout as the DFlash ones, and a short batch
TINY_TARGET = {**TINY, "num_key_value_heads": 2, "head_dim": 16}
TINY_DRAFTER = {"num_hidden_layers": 2, "hidden_size": TINY["hidden_size"], "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mask_token_id": None}
TINY_DATA = ["data.max_length=128", "data.batch_size=2", "objective.anchors_per_seq=4",
             "stages.exittrain.anchors_per_seq=4"]
TINY_CONTEXT = 32


# ----------------------------------------------------------------------------------------------
# goals


def goal_verdict(ratio: float | None, goal: tuple[float, float]) -> str:
    """``met`` when ``goal[0] <= ratio <= goal[1]``, ``missed`` otherwise, ``not measured`` for None."""
    if ratio is None:
        return "not measured"
    return "met" if goal[0] <= ratio <= goal[1] else "missed"


def ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is not > 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


# ----------------------------------------------------------------------------------------------
# the settings of one target


def dflash_shape(target_name: str) -> dict:
    """The DFlash drafter ``plan`` assumes for ``target_name`` (its ``KNOWN_DFLASH`` entry)."""
    from exittrain.plan import KNOWN_DFLASH

    found = [v for v in KNOWN_DFLASH.values() if v["target"] == target_name]
    if not found:
        raise ValueError(f"no DFlash drafter known for {target_name}; known: {sorted(KNOWN_DFLASH)}")
    return found[0]


def drafter_overrides(shape: dict) -> list[str]:
    """Overrides that make ``cfg.drafter`` build the drafter of a DFlash ``shape`` (a ``KNOWN_DFLASH``
    entry's fields), as ``plan``'s ``meta_drafter`` builds it from a DFlash config: no copy branch,
    the mask token's embedding as the mask rows where there is one, a random start."""
    mask = shape["mask_token_id"]
    ids = ",".join(str(i) for i in shape["target_layer_ids"])
    return [
        f"drafter.block_size={shape['block_size']}", f"drafter.num_layers={shape['num_hidden_layers']}",
        f"drafter.hidden_size={shape['hidden_size']}", f"drafter.layer_ids=[{ids}]", "drafter.copy_ngrams=[]",
        "drafter.init_from_layers=null", f"+drafter.num_heads={shape['num_attention_heads']}",
        f"+drafter.num_key_value_heads={shape['num_key_value_heads']}", f"+drafter.head_dim={shape['head_dim']}",
        f"+drafter.intermediate_size={shape['intermediate_size']}",
        f"+drafter.mask_token_id={'null' if mask is None else mask}", f"+drafter.learned_mask={mask is None}".lower(),
    ]  # fmt: skip


def tiny_target_folder(target_name: str, folder: Path) -> tuple[str, dict]:
    """Write a tiny config.json of ``target_name``'s family (``KNOWN_CONFIGS``, shapes of
    :data:`TINY_TARGET`) into ``folder``; returns ``(folder, the tiny drafter's shape)``."""
    from transformers import AutoConfig

    from exittrain.models.dflash_format import default_target_layer_ids
    from exittrain.plan import KNOWN_CONFIGS

    known = dict(KNOWN_CONFIGS[target_name])
    config = AutoConfig.for_model(known.pop("model_type"), **{**known, **TINY_TARGET})
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    layers = default_target_layer_ids(TINY_TARGET["num_hidden_layers"], TINY_DRAFTER["num_hidden_layers"])
    return str(folder), {**dflash_shape(target_name), **TINY_DRAFTER, "target_layer_ids": layers}


def check_overrides(name: str, device: torch.device, tiny_folder: Path | None) -> list[str]:
    """The ``fit`` overrides of target ``name``'s check (see the module docstring)."""
    from omegaconf import OmegaConf

    from exittrain.configs import CONF_DIR

    hub_id = str(OmegaConf.load(CONF_DIR / "target" / f"{name}.yaml").name_or_path)
    overrides = [f"+experiment={name}_ddp", f"trainer={'gpu' if device.type == 'cuda' else 'cpu'}",
                 "trainer.devices=1", "trainer.precision=bf16-mixed", "target.dtype=bfloat16"]  # fmt: skip
    if tiny_folder is None:
        return overrides + drafter_overrides(dflash_shape(hub_id))
    path, shape = tiny_target_folder(hub_id, tiny_folder / name)
    return overrides + [f"target.name_or_path={path}", *TINY_DATA] + drafter_overrides(shape)


def random_target(cfg, device: torch.device):
    """A :class:`~exittrain.models.TargetModel` of ``cfg.target``'s config with random weights in
    ``cfg.target.dtype``, built on ``device`` (no weight file read)."""
    from transformers import AutoModelForCausalLM

    from exittrain.models import TargetModel
    from exittrain.models.target_loading import as_dtype
    from exittrain.plan.models import target_config

    config, name, _ = target_config(cfg.target)
    config.eos_token_id = None  # random weights: no sampled token may end a timed decode early
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=as_dtype(cfg.target.dtype), attn_implementation="sdpa")
    return TargetModel(model, name=name)


def synthetic_batch(L: int, T: int, V: int, top_k: int, device: torch.device, seed: int = 0) -> dict:
    """A batch in :class:`~exittrain.data.collate.Collator`'s layout: L rows of T random ids, the first
    T // 16 a prompt and the rest the response (so every anchor is valid, as the plan counts), with
    the feature store's soft labels ``top_ids`` (L, T, k) int32 and ``top_logprobs`` (L, T, k) fp32
    (id 0 and -inf over the prompt); moved to ``device``."""
    from exittrain.data.collate import Collator

    g = torch.Generator().manual_seed(seed)
    prompt = T // 16
    ids_LT = torch.randint(2, V, (L, T), generator=g)
    mask = [False] * prompt + [True] * (T - prompt)
    rows = [{"input_ids": ids.tolist(), "loss_mask": mask, "n_prompt_tokens": prompt} for ids in ids_LT]
    batch = Collator(pad_token_id=0, max_length=T)(rows)
    top_ids_LTk = torch.randint(0, V, (L, T, top_k), generator=g, dtype=torch.int32)
    top_logp_LTk = torch.log_softmax(torch.randn(L, T, top_k, generator=g), -1).sort(-1, descending=True).values
    top_ids_LTk[:, :prompt], top_logp_LTk[:, :prompt] = 0, -torch.inf
    batch.update(top_ids=top_ids_LTk, top_logprobs=top_logp_LTk)
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------
# measuring


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _clock(device: torch.device):
    return lambda: device_now(device)


def guarded(what: str, device: torch.device, row: dict, measure) -> dict:
    """``row`` with ``status: ok`` and what ``measure()`` returns; where it raises, the error instead
    (``status``: ``out of memory`` for ``torch.cuda.OutOfMemoryError``, else ``error``; ``reason``),
    logged, so that one point's failure costs the device run none of the others' figures."""
    try:
        return {**row, "status": "ok", **measure()}
    except Exception as e:  # noqa: BLE001 -- recorded in the row; main exits 1 after writing when any is an error
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        (log.warning if oom else log.exception)("%s failed (%s); going on", what, type(e).__name__)
        failed = {"status": "out of memory" if oom else "error",
                  "reason": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    _free(device)  # after the handler: the traceback no longer holds the point's tensors
    return {**row, **failed}


def optimizer_step(module, optimizer, batch: dict, autocast, clip: float | None) -> None:
    """One training step as Lightning runs it: ``training_step`` under ``autocast``, backward,
    gradient clipping (``clip``: ``trainer.gradient_clip_val``), AdamW, gradients set to None."""
    with autocast, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")  # no Trainer: nothing is logged
        loss = module.training_step(batch, 0)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(module.drafter.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _timed_steps(cfg, plan, stage: str, drafter, target, repeats: int) -> dict:
    """One warm-up step, then ``repeats`` timed ones: their times and the peak memory over them."""
    from exittrain.build import build_module
    from exittrain.lit.schedule import adamw_with_schedule

    device = target.device
    module = build_module(cfg, stage, drafter, target).to(device)
    module.drafter.train()
    try:
        optimizer = adamw_with_schedule(module.drafter, module.optim, cfg.stages[stage].max_steps)["optimizer"]
        L, T = int(cfg.data.batch_size), int(cfg.data.max_length)
        batch = synthetic_batch(L, T, target.vocab_size, module.objective.soft_label_top_k, device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if plan.precision["autocast"] else (
            contextlib.nullcontext())
        clip = cfg.trainer.get("gradient_clip_val")
        optimizer_step(module, optimizer, batch, autocast, clip)  # warm-up: kernels, the AdamW moments
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        laps = []
        for _ in range(repeats):
            start = device_now(device)
            optimizer_step(module, optimizer, batch, autocast, clip)
            laps.append(1e3 * (device_now(device) - start))
        if device.type == "cuda":
            measured, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            method = "torch.cuda.max_memory_allocated"
        else:
            measured, reserved, method = None, None, "not measured (CPU: the resident size counts more than the step)"
        return {"step_ms": statistics.median(laps), "step_ms_all": laps, "measured_peak_bytes": measured,
                "measured_reserved_bytes": reserved, "memory_method": method}
    finally:
        module.drafter.zero_grad(set_to_none=True)  # the next step kind starts from the drafter alone


def measure_step(cfg, plan, stage: str, drafter, target, repeats: int) -> dict:
    """One step kind (see the module docstring, 1): the plan's peak and the measured one, the step time;
    skipped, with the reason, where the plan says the step does not fit the device."""
    from exittrain.plan.result import fit_verdict
    from exittrain.settings import stage_module_args

    planned = next(s for s in plan.steps if s.stage == stage and s.kind == "train")
    args = stage_module_args(cfg, stage)
    items = [{"name": i.name, "formula": i.formula, "bytes": i.bytes} for i in planned.items]
    row = {"stage": stage, "L": int(cfg.data.batch_size), "T": int(cfg.data.max_length), "A": args["anchors_per_seq"],
           "B": args["budget"], "planned_peak_bytes": planned.peak, "planned_peak_phase": planned.peak_phase,
           "planned_items": items}  # fmt: skip
    if fit_verdict(planned.peak + plan.reserve, plan.capacity) == "does not fit":
        reason = (f"plan: {human(planned.peak)} + {human(plan.reserve)} ({plan.reserve_source}) does not fit "
                  f"{human(plan.capacity)} ({plan.capacity_source})")  # fmt: skip
        out = {**row, "status": "skipped", "reason": reason}
    else:
        out = guarded(f"{stage} step", target.device, row,
                      lambda: _timed_steps(cfg, plan, stage, drafter, target, repeats))
    out["ratio"] = ratio_of(out.get("measured_peak_bytes"), planned.peak)
    out["verdict"] = goal_verdict(out["ratio"], MEMORY_GOAL) if out["status"] == "ok" else out["status"]
    return out


@torch.no_grad()
def _score_against_plain(target, L: int, T: int, A: int, B: int, repeats: int) -> dict:
    device = target.device
    Q = A * (B + 1)
    ids_1T, anchors_1A, trees = make_inputs(target, T, B, A)  # one sequence's, repeated to L
    ids_LT, anchors_LA = ids_1T.expand(L, T).contiguous(), anchors_1A.expand(L, A).contiguous()
    trees = trees.index(torch.arange(A).repeat(L))
    plain_ids_LTQ = torch.randint(2, target.vocab_size, (L, T + Q), device=device)
    score_ms, plain_ms = alternating_medians([
        lambda: target.score_trees(ids_LT, anchors_LA, trees, mode="exact"),
        lambda: target.model(input_ids=plain_ids_LTQ, use_cache=False, logits_to_keep=Q),
    ], repeats, clock=_clock(device))  # fmt: skip
    ratio = ratio_of(score_ms, plain_ms)
    return {"score_ms": score_ms, "plain_ms": plain_ms, "ratio": ratio, "verdict": goal_verdict(ratio, SCORING_GOAL)}


def measure_scoring(target, L: int, T: int, A: int, B: int, repeats: int) -> dict:
    """Tree scoring against a plain forward over the same rows (see the module docstring, 2)."""
    row = {"L": L, "T": T, "A": A, "B": B, "tree_rows": L * A * (B + 1)}
    return guarded("tree scoring", target.device, row, lambda: _score_against_plain(target, L, T, A, B, repeats))


@torch.no_grad()
def _verifier_ms(device: torch.device, tree, logits, repeats: int) -> dict:
    from exittrain.core.verify import verify_greedy, verify_sequential, verify_tev

    gen = torch.Generator(device=device).manual_seed(1)
    # a fresh tree object per call: the ancestor mask is built inside the timed region
    tev, greedy, sequential = alternating_medians([
        lambda: verify_tev(tree.index(slice(None)), logits, generator=gen, validate=False),
        lambda: verify_greedy(tree.index(slice(None)), logits, validate=False),
        lambda: verify_sequential(tree.index(slice(None)), logits, generator=gen, validate=False),
    ], repeats, clock=_clock(device))  # fmt: skip
    return {"tev_ms": tev, "greedy_ms": greedy, "sequential_ms": sequential,
            "tev_over_greedy": ratio_of(tev, greedy), "tev_over_sequential": ratio_of(tev, sequential)}


def measure_verifiers(target, K: int, budgets: list[int], repeats: int) -> list[dict]:
    """TEV, greedy and sequential on one tree of each budget (see the module docstring, 3)."""
    from exittrain.core import build_tree

    device, V = target.device, target.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for B in budgets:
        tree = build_tree(drafter_logprobs(1, K, V, device, g), B)
        logits_1BV = agreeing_target_logits(tree, V, g).to(target.dtype)  # as a tree forward returns them
        rows.append(guarded(f"verifiers B={B}", device, {"B": B, "V": V, "K": K},
                            lambda tree=tree, logits=logits_1BV: _verifier_ms(device, tree, logits, repeats)))
    return rows


def _round_ms(rounds) -> float:
    """Median ms of a decode's rounds, without the first (warm-up) and the last (no commit)."""
    inner = rounds[1:-1] or rounds
    return 1e3 * statistics.median(sum(r.times.values()) for r in inner)


def measure_decode(target, drafter, budgets: list[int], context: int, rounds: int) -> list[dict]:
    """A decode round at each budget against an autoregressive step (see the module docstring, 4)."""
    from exittrain.decoding import SpeculativeDecoder, autoregressive_generate

    device = target.device
    prompt_C = torch.randint(2, target.vocab_size, (context,), generator=torch.Generator().manual_seed(2))
    drafter.eval()
    step = guarded("autoregressive step", device, {},
                   lambda: {"step_ms": _round_ms(autoregressive_generate(target, prompt_C, rounds + 2).rounds)})

    def round_against_step(B: int) -> dict:
        out = SpeculativeDecoder(target, drafter, budget=B, verifier="tev").generate(
            prompt_C, max_new_tokens=rounds + 2, temperature=0.0)
        round_ms = _round_ms(out.rounds)
        return {"round_ms": round_ms, "ratio": ratio_of(round_ms, step.get("step_ms")), "rounds": len(out.rounds)}

    rows = []
    for B in budgets:
        row = {"B": B, "context": context, "step_ms": step.get("step_ms")}
        rows.append(guarded(f"decode B={B}", device, row, lambda B=B: round_against_step(B)) if step["status"] == "ok"
                    else {**row, "status": step["status"], "reason": f"autoregressive step: {step['reason']}"})
    return rows


def check_target(name: str, device: torch.device, tiny_folder: Path | None, budgets: list[int], repeats: int,
                 context: int) -> dict:
    """Every measurement of one target (see the module docstring); the target is freed on return."""
    from exittrain.build import build_drafter
    from exittrain.plan import compose_fit, make_plan
    from exittrain.settings import stage_module_args

    start = time.perf_counter()

    def stage(what: str) -> None:
        _free(device)
        log.info("%s: %s (%.0f s)", name, what, time.perf_counter() - start)

    overrides = check_overrides(name, device, tiny_folder)
    stage("planning")
    cfg = compose_fit(overrides)
    plan = make_plan(overrides)
    out = {"target": name, "name": plan.target["name"], "overrides": overrides, "plan_target": plan.target,
           "plan_drafter": plan.drafter, "plan_precision": plan.precision, "capacity_bytes": plan.capacity,
           "capacity_source": plan.capacity_source, "steps": []}  # fmt: skip
    stage(f"building the random {plan.target['name']} ({parameters(plan.target['params'])}) and drafter "
          f"({parameters(plan.drafter['params'])})")
    target = drafter = None
    try:
        target = random_target(cfg, device)
        drafter = build_drafter(cfg, target)
        out["drafter_params"] = sum(p.numel() for p in drafter.parameters())  # the plan's, if it built the same
        for kind in STEP_STAGES:
            stage(f"{kind} training step")
            out["steps"].append(measure_step(cfg, plan, kind, drafter, target, repeats))
        args = stage_module_args(cfg, "exittrain")
        stage("tree scoring against a plain forward")
        out["scoring"] = measure_scoring(target, int(cfg.data.batch_size), int(cfg.data.max_length),
                                         args["anchors_per_seq"], args["budget"], repeats)
        stage("verifiers")
        out["verify"] = measure_verifiers(target, drafter.config.num_draft_tokens, budgets, VERIFY_REPEATS)
        stage("decode rounds")
        out["decode"] = measure_decode(target, drafter, budgets, context, DECODE_ROUNDS)
        stage("done")
    finally:
        target = drafter = None  # both freed before the next target loads
        _free(device)
    return out


def run(targets: list[str], device: torch.device, tiny: bool, budgets: list[int], repeats: int, context: int) -> dict:
    """Every target's check, one after the other, and the host they ran on."""
    facts = host()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(cuda_memory_bytes=int(props.total_memory), cuda_capability=f"{props.major}.{props.minor}",
                     cuda_runtime=torch.version.cuda)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) if tiny else None
        # a target whose check fails as a whole (planning, building) is recorded, and the next one runs
        checks = [guarded(f"{name} check", device, {"target": name},
                          lambda name=name: check_target(name, device, folder, budgets, repeats, context))
                  for name in targets]
    return {"host": facts, "device": str(device), "tiny": tiny, "repeats": repeats, "budgets": budgets,
            "memory_goal": list(MEMORY_GOAL), "scoring_goal": SCORING_GOAL[1], "targets": checks}


# ----------------------------------------------------------------------------------------------
# the table


def parameters(n: int) -> str:
    """A parameter count as ``8.19B``, ``436.2M`` or ``82.4k``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def _ms(value) -> str:
    return cell(value, "{:.1f}")


def _x(value) -> str:
    return cell(value, "{:.2f}x")


def _goal(point: dict) -> str:
    """The point's verdict where it ran, else its status (skipped, out of memory, error)."""
    return point.get("verdict", point["status"]) if point["status"] == "ok" else point["status"]


def to_markdown(result: dict) -> str:
    """The check's tables, one section per measurement, each saying what its sides count."""
    h = result["host"]
    device = h.get("cuda") if result["device"].startswith("cuda") else "CPU"
    lines = [f"# GPU check{' (CPU twin, tiny shapes)' if result['tiny'] else ''}", "",
             f"Device: {device} ({result['device']}); host: {host_line(h)}. Random weights; medians of "
             f"{result['repeats']} timed repeats after a warm-up; {result['seconds']:.0f} s in all.", ""]  # fmt: skip
    checks = result["targets"]
    for c in checks:
        if c["status"] != "ok":
            lines.append(f"- {c['target']}: {c['status']}: {c['reason']}")
            continue
        t, d = c["plan_target"], c["plan_drafter"]
        lines.append(f"- {c['target']}: {t['name']}, {parameters(t['params'])} parameters ({t['source']}); drafter "
                     f"{parameters(d['params'])} parameters, {d['layers']} layers, block {d['block_size']}")
    lines.append("")
    lo, hi = result["memory_goal"]
    lines += ["## Training steps: memory and time", "",
              "measured = peak of `torch.cuda.max_memory_allocated` over the timed steps (live tensors of the process; "
              f"no CUDA context, no cached blocks; not measured on a CPU). plan = the step's largest phase in "
              f"`plan` (no CUDA context either). Goal: measured / plan within {lo:.2f}-{hi:.2f}.", ""]  # fmt: skip
    rows = [[c["target"], s["stage"], f"{s['L']}x{s['T']}, A={s['A']}, B={s['B']}",
             f"{human(s['planned_peak_bytes'])} ({s['planned_peak_phase']})", human(s.get("measured_peak_bytes")),
             human(s.get("measured_reserved_bytes")), _x(s.get("ratio")), _goal(s), _ms(s.get("step_ms")),
             s.get("reason", "")] for c in checks for s in c.get("steps", [])]  # fmt: skip
    lines += markdown_table(["target", "step", "L x T, anchors, budget", "plan peak (phase)", "measured peak",
                             "reserved", "measured / plan", "goal", "step (ms)", "note"], rows)
    lines += ["", "## Tree scoring against a plain forward", "",
              "score = `score_trees` (exact, one forward for all anchors) over L x T tokens and A trees of B nodes "
              "per sequence; plain = one causal forward over L x (T + A(B+1)) tokens keeping the last A(B+1) "
              f"logits. Goal: score / plain <= {result['scoring_goal']}x.", ""]  # fmt: skip
    rows = [[c["target"], f"{s['L']}x{s['T']}, A={s['A']}, B={s['B']}", s["tree_rows"], _ms(s.get("score_ms")),
             _ms(s.get("plain_ms")), _x(s.get("ratio")), _goal(s), s.get("reason", "")]
            for c in checks if "scoring" in c for s in [c["scoring"]]]  # fmt: skip
    lines += markdown_table(["target", "L x T, anchors, budget", "tree rows", "score (ms)", "plain (ms)",
                             "score / plain", "goal", "note"], rows)
    lines += ["", "## Verifiers", "",
              "One tree (N = 1, a decoding round) of B nodes, K = the drafter's horizon, V = the target's, target "
              "logits in the target's dtype; TEV and sequential at temperature 1, greedy at 0. The paper reports -15% "
              "verifier latency at B = 64.", ""]  # fmt: skip
    rows = [[c["target"], r["B"], _ms(r.get("tev_ms")), _ms(r.get("greedy_ms")), _ms(r.get("sequential_ms")),
             _x(r.get("tev_over_greedy")), _x(r.get("tev_over_sequential")), r.get("reason", "")]
            for c in checks for r in c.get("verify", [])]  # fmt: skip
    lines += markdown_table(["target", "B", "TEV (ms)", "greedy (ms)", "sequential (ms)", "TEV / greedy",
                             "TEV / sequential", "note"], rows)
    lines += ["", "## Decode round against an autoregressive step", "",
              "round = one speculative round (TEV, temperature 0: draft, tree, target over B+1 rows, verify, commit); "
              "step = one autoregressive step; both after a prompt of C tokens, medians of the rounds between the "
              "first and the last. Speedup <= tau / (round / step).", ""]  # fmt: skip
    rows = [[c["target"], r["B"], r["context"], _ms(r.get("round_ms")), _ms(r.get("step_ms")), _x(r.get("ratio")),
             r.get("reason", "")] for c in checks for r in c.get("decode", [])]
    lines += markdown_table(["target", "B", "C", "round (ms)", "step (ms)", "round / step", "note"], rows)
    return "\n".join(lines) + "\n"


def failed_points(result: dict) -> list[str]:
    """``target section: reason`` of every point whose status is ``error``."""
    out = []
    for c in result["targets"]:
        points = [("check", c)] + [("steps", p) for p in c.get("steps", [])]
        points += [("scoring", c["scoring"])] if "scoring" in c else []
        points += [("verify", p) for p in c.get("verify", [])] + [("decode", p) for p in c.get("decode", [])]
        out += [f"{c['target']} {section}: {p['reason']}" for section, p in points if p["status"] == "error"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU twin: tiny random configs, the same code path")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda; cpu with --tiny)")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                        help="tree budgets of the verifier and decode sections")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up")
    parser.add_argument("--context", type=int, default=None, help=f"decode prompt tokens (1024; {TINY_CONTEXT} tiny)")
    parser.add_argument("--out", default="results/gpu_check")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; run --tiny (the CPU twin) or on a GPU host")
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: need >= 1")
    try:
        budgets = check_counts(args.budgets, "--budgets")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    context = args.context or (TINY_CONTEXT if args.tiny else 1024)
    start = time.perf_counter()
    result = run(args.targets, device, args.tiny, budgets, args.repeats, context)
    result["seconds"] = time.perf_counter() - start  # to_markdown reads it
    log.info("gpu check done in %.0f s", result["seconds"])
    write_results(args.out, result, to_markdown(result))
    failed = failed_points(result)
    if failed:
        raise SystemExit(f"{len(failed)} point(s) failed with an error (not out of memory): {'; '.join(failed)}; "
                         f"see {args.out}.md and the log above")


if __name__ == "__main__":
    main()
