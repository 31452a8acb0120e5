"""Making a plan: one composed config planned (:func:`make_plan`), rank 0's regeneration, the
device's capacity, and the changes that lower the peak, each re-planned."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path

from exittrain.plan.memory import (
    Item,
    Shapes,
    Step,
    corpus_rows,
    data_compute,
    data_items,
    parse_size,
    persistent,
    schedule,
    step,
)
from exittrain.plan.models import (
    PRECISIONS,
    compose_fit,
    meta_drafter,
    meta_target,
    resolve_dtypes,
    target_config,
    target_device,
    world_layout,
)
from exittrain.plan.result import MARGIN, Plan, fit_verdict

GiB = 2**30
CUDA_CONTEXT = GiB  # the upper end of a CUDA context's 0.5-1 GiB per process


def _plan(cfg, overrides: list[str], models: dict, dtype_override=None, device_gpus: int | None = None) -> Plan:
    """The plan of one composed config (see :func:`make_plan`)."""
    import torch
    from omegaconf import OmegaConf

    from exittrain.settings import check_fit_config, stage_module_args

    stages = check_fit_config(cfg).stages
    notes: list[str] = []
    precision, dtype = resolve_dtypes(cfg, notes)
    if dtype_override is not None:
        dtype = dtype_override
    devices, nodes, strategy = world_layout(cfg)
    world = devices * nodes
    key = (str(cfg.target.get("name_or_path")), str(dtype))
    if key not in models:
        config, name, source = target_config(cfg.target)
        models[key] = (meta_target(config, name, dtype), source)
    target, source = models[key]
    dkey = (key, str(cfg.warm_start), json.dumps(OmegaConf.to_container(cfg.drafter, resolve=True), sort_keys=True))
    if dkey not in models:
        models[dkey] = meta_drafter(cfg, target)
    drafter, d_source = models[dkey]
    if "KNOWN" in source or "KNOWN" in d_source:
        notes.append("read from the tables of exittrain/plan/models.py, not from a local config.json: " +
                     "; ".join(x for x in (source, d_source) if "KNOWN" in x))
    unique = {id(p): p for p in target.model.parameters()}.values()
    t_params = sum(p.numel() for p in unique)
    st = torch.tensor([], dtype=dtype).element_size()
    t_bytes = t_params * st + sum(b.numel() * b.element_size() for b in target.model.buffers())
    Pd = sum(p.numel() for p in drafter.parameters())
    pb, autocast = PRECISIONS[precision]
    tc, dc = target.config, drafter.config
    s = Shapes(
        V=target.vocab_size, H=target.hidden_size, I=int(tc.intermediate_size), layers=target.num_layers,
        heads=int(tc.num_attention_heads), kv=int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads),
        hd=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads), st=st,
        D=dc.hidden_size, Id=dc.intermediate_size, d_layers=dc.num_layers, d_heads=dc.num_heads,
        d_kv=dc.num_key_value_heads, d_hd=dc.head_dim, S=dc.block_size, F=dc.feature_size,
        copy=bool(dc.copy_ngrams), pb=pb, autocast=autocast,
    )
    args = {stage: stage_module_args(cfg, stage) for stage in ("pretrain", "exittrain")}
    gpus = 1
    if cfg.target.get("device_map") is not None:
        gpus = device_gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
        notes.append(f"target.device_map: its weights and K/V spread over {gpus} GPU(s); the rest sits on the first")
    soft = any(args[x].get("soft_label_weight", 0) > 0 for x in stages)
    top_k = max((args[x].get("soft_label_top_k", 16) for x in stages), default=16) if soft else 0
    data = data_items(s, cfg, cfg.data.get("max_train_prompts"), bool(cfg.objective.feature_cache), top_k)
    base = persistent(s, t_bytes, Pd, world, strategy, gpus)
    if target_device(cfg) == "cpu":  # the device is the host: the feature store shares it
        base.append(Item("feature store (host memory of the process)", data[-1].formula, data[-1].bytes))
    if gpus > 1:
        s = Shapes(**{**asdict(s), "layers": max(1, s.layers // gpus)})  # the first GPU holds 1/gpus of the K/V
    L, T = int(cfg.data.batch_size), int(cfg.data.max_length)
    steps = []
    for stage in stages:
        steps.append(step(s, base, args[stage], L, T, stage=stage, kind="train"))
        if float(cfg.data.val_fraction) > 0:
            steps.append(step(s, base, args[stage], L, T, stage=stage, kind="val"))
    steps.append(_regeneration(s, cfg, t_bytes // gpus, Pd))
    if corpus_rows(cfg) != 0:
        steps.append(_corpus_labelling(s, cfg, t_bytes // gpus, Pd))
    return Plan(
        overrides=list(overrides),
        target={"name": target.name, "source": source, "params": t_params, "dtype": str(dtype), "bytes": t_bytes,
                "bf16_bytes": t_params * 2, "layers": s.layers * gpus, "hidden": s.H, "vocab": s.V},
        drafter={"params": Pd, "layers": s.d_layers, "width": s.D, "block_size": s.S, "source": d_source,
                 "layer_ids": list(dc.target_layer_ids)},
        precision={"trainer": str(precision), "param_bytes": pb, "autocast": autocast, "target_dtype": str(dtype)},
        world={"devices": devices, "nodes": nodes, "world_size": world, "strategy": strategy},
        steps=steps, data=data, schedule={**schedule(cfg, stages, args, world), **data_compute(cfg, t_params)},
        notes=notes,
    )  # fmt: skip


def _generation_dtype(s: Shapes, cfg) -> tuple[str | None, int]:
    """The dtype the data step runs the target in (``data.generation.dtype``; ``auto`` resolved for the run's
    device) and its bytes per element (the target's own for None)."""
    import torch

    from exittrain.models.target_loading import as_dtype
    from exittrain.precision import generation_dtype

    device = target_device(cfg)
    wanted = cfg.data.generation.get("dtype")
    if wanted == "auto":
        wanted = "bfloat16" if device == "cuda" else generation_dtype("auto", device)
    return wanted, s.st if wanted is None else torch.tensor([], dtype=as_dtype(wanted)).element_size()


def _regeneration(s: Shapes, cfg, t_bytes: int, Pd: int) -> Step:
    """Rank 0's regeneration (skipped when the cache holds the entry): the target, a copy of it in the
    generation dtype, and the answering batch's K/V."""
    gen = cfg.data.generation
    wanted, sg = _generation_dtype(s, cfg)
    drafter = Item("drafter parameters (built before the data)", f"P_d*{s.pb}", Pd * s.pb)
    weights = [Item("target weights", "", t_bytes), drafter]
    phases = {}
    if sg != s.st:  # generation.py: copy.deepcopy(model).to(dtype)
        phases["copying the target"] = weights + [Item("deepcopy of the target, before its cast", "", t_bytes)]
        weights.append(Item(f"the target's copy in {wanted}", f"P_t*{sg}", t_bytes * sg // s.st))
    prompts = cfg.data.get("max_train_prompts")
    rows = min(int(gen.batch_size), int(prompts)) if prompts is not None else int(gen.batch_size)
    prompt = int(gen.get("max_prompt_tokens", 512))
    n = prompt + int(gen.max_new_tokens)
    phases["answering"] = weights + [
        Item("answering batch K/V", f"layers*2*batch*(max_prompt_tokens+max_new_tokens)*kv*hd*{sg} = {rows}x{n}",
             s.kv_bytes(rows, n, sg)),
        Item("one target layer over the prompts", f"~ batch*max_prompt_tokens = {rows * prompt} rows",
             s.target_layer_rows(rows * prompt, sg)),
    ]  # fmt: skip
    return Step("data", "regeneration (rank 0, uncached)", phases)


def _corpus_labelling(s: Shapes, cfg, t_bytes: int, Pd: int) -> Step:
    """Rank 0's teacher-forced pass over the corpus rows (skipped when the cache holds their entry): the
    target in the generation dtype, one batch of rows at once (:mod:`exittrain.data.teacher_forced`): its
    kept logits, their fp32 log-softmax, the captured features and one layer's activations over the batch."""
    from exittrain.data.brought import TEACHER_FORCED_BATCH

    wanted, sg = _generation_dtype(s, cfg)
    n, T, V = TEACHER_FORCED_BATCH, int(cfg.data.max_length), s.V
    weights = [Item("target weights", "", t_bytes),
               Item("drafter parameters (built before the data)", f"P_d*{s.pb}", Pd * s.pb)]
    if sg != s.st:
        weights.append(Item(f"the target's copy in {wanted}", f"P_t*{sg}", t_bytes * sg // s.st))
    phases = {"labelling": weights + [
        Item("one target layer over the batch", f"~ {n}*max_length = {n * T} rows", s.target_layer_rows(n * T, sg)),
        Item("captured feature layers (bf16)", f"{n}*max_length*F*2", n * T * s.F * 2),
        Item("kept logits, their fp32 copy and log-softmax", f"{n}*max_length*V*({sg}+4+4) (every row all answer)",
             n * T * V * (sg + 8)),
    ]}  # fmt: skip
    return Step("data", f"corpus labelling (rank 0, uncached, {n} rows a forward)", phases)


# ----------------------------------------------------------------------------------------------
# entry points


def _capacity(cfg, device_memory: str | None) -> tuple[int | None, str, int, str]:
    """``(capacity, where from, reserve, what the reserve is)`` of one device of the run."""
    import torch

    gpu = str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda")
    if gpu:
        reserve, why = CUDA_CONTEXT, "CUDA context"
    else:
        status = Path("/proc/self/status")
        rss = re.search(r"^VmRSS:\s+(\d+) kB", status.read_text(), re.M) if status.is_file() else None
        reserve, why = (int(rss.group(1)) * 1024 if rss else 0), "this plan process's own RSS (libraries loaded)"
    if device_memory is not None:
        return parse_size(device_memory), "--device-memory", reserve, why
    if gpu and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"{props.name}", reserve, why
    if not gpu and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory", reserve, why
    return None, "", reserve, why


def _with(overrides: list[str], *changes: str) -> list[str]:
    """``overrides`` with each ``key=value`` of ``changes`` replacing an override of the same key."""
    keys = {c.split("=", 1)[0].lstrip("+") for c in changes}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys] + list(changes)


def _replanned_peak(plan: Plan, overrides: list[str], models: dict, change: list[str], gpus: int | None) -> int:
    """The peak of ``overrides`` with ``change``; with ``device_map`` over one GPU, accelerate offloads to CPU
    memory as much of the target as the device lacks (at most all of it)."""
    new_overrides = _with(overrides, *change)
    peak = _plan(compose_fit(new_overrides), new_overrides, models, device_gpus=gpus).peak
    if gpus == 1 and plan.capacity is not None:
        room = int((1 - MARGIN) * plan.capacity) - plan.reserve
        peak = peak if peak <= room else max(peak - plan.target["bytes"], room)
    return peak


def _suggestions(plan: Plan, cfg, overrides: list[str], models: dict) -> list[dict]:
    """Each change re-planned, those that lower the peak largest saving first; then, when none of them
    fits alone, all of them together (with the layout change that saves most)."""
    w = plan.world
    A = max(int(cfg.objective.anchors_per_seq), int(cfg.stages.exittrain.get("anchors_per_seq", 0) or 0))
    L = int(cfg.data.batch_size)
    changes: list[tuple[list[str], str, int | None, bool]] = []  # (overrides, note, device_map GPUs, layout)
    chunk = cfg.tree.get("score_chunk_size")
    if chunk is None or chunk > 1:
        c = max(1, (chunk or A) // 4)
        changes.append(([f"tree.score_chunk_size={c}"], "more target forwards per step (slower scoring)", None, False))
    if cfg.objective.feature_cache:
        changes.append((["objective.feature_cache=false"], "the target computes the features every step", None, False))
    if w["world_size"] > 1 and w["strategy"] != "fsdp":
        changes.append((["trainer=fsdp"], "the drafter's state sharded over the ranks", None, True))
    if cfg.target.get("device_map") is None and target_device(cfg) == "cuda":
        G = w["devices"]
        note = (f"one process per node, the target over its {G} GPUs: {G}x fewer data-parallel ranks" if G > 1
                else "one GPU: accelerate offloads to CPU memory what does not fit, every forward streams it (slow)")
        changes.append((["target.device_map=auto", "trainer.devices=1"], note, G, True))
    if L > 1:
        changes.append(([f"data.batch_size={L // 2}"], "half the rows per step (changes the training)", None, False))
    answering = int(cfg.data.generation.batch_size)
    if answering > 1:
        changes.append(([f"data.generation.batch_size={answering // 2}"], "the regeneration answers fewer prompts at "
                        "once (slower; rank 0, only when the cache lacks the entry)", None, False))
    if any(i.name.startswith("deepcopy of the target") for st in plan.steps for p in st.phases.values() for i in p):
        changes.append((["data.generation.dtype=null"], "the regeneration answers with the target as loaded (no "
                        "copy; slower where bf16 is faster)", None, False))
    if A > 1:
        changes.append(([f"stages.exittrain.anchors_per_seq={A // 2}", f"objective.anchors_per_seq={A // 2}"],
                        "half the anchors per row (changes the training)", None, False))
    out = []
    for change, note, gpus, layout in changes:
        peak = _replanned_peak(plan, overrides, models, change, gpus)
        if peak < plan.peak:
            out.append({"change": " ".join(change), "saves": plan.peak - peak, "peak": peak,
                        "verdict": fit_verdict(peak + plan.reserve, plan.capacity), "note": note, "layout": layout,
                        "gpus": gpus, "overrides": change})  # fmt: skip
    out.sort(key=lambda x: -x["saves"])
    if out and not any(x["verdict"] == "fits" for x in out) and len(out) > 1:
        layouts = [x for x in out if x["layout"]][:1]
        chosen = [x for x in out if not x["layout"]] + layouts
        together = [o for x in chosen for o in x["overrides"]]
        peak = _replanned_peak(plan, overrides, models, together, layouts[0]["gpus"] if layouts else None)
        out.append({"change": "all of: " + " ".join(together), "saves": plan.peak - peak, "peak": peak,
                    "verdict": fit_verdict(peak + plan.reserve, plan.capacity), "note": "every change above at once",
                    "layout": bool(layouts), "gpus": None, "overrides": together})  # fmt: skip
    return out


def make_plan(overrides: list[str], *, device_memory: str | None = None) -> Plan:
    """The plan of ``python -m exittrain fit OVERRIDES`` (see the docstring of :mod:`exittrain.plan`).

    ``device_memory`` (e.g. ``"80GiB"``): one device's size; default the GPU's (CUDA visible), the
    host's memory for a CPU run, else none (no verdict). ValueError naming the key for a bad
    override, target, warm start, trainer setting or size."""
    if device_memory is not None:
        parse_size(device_memory)  # a bad size fails before the config is read
    import torch

    cfg = compose_fit(overrides)
    models: dict = {}
    plan = _plan(cfg, overrides, models)
    if plan.precision["target_dtype"] != str(torch.bfloat16):
        plan.bf16_peak = _plan(cfg, overrides, models, dtype_override=torch.bfloat16).peak
    plan.capacity, plan.capacity_source, plan.reserve, plan.reserve_source = _capacity(cfg, device_memory)
    if plan.capacity is not None and plan.verdict != "fits":
        plan.suggestions = _suggestions(plan, cfg, overrides, models)
    return plan
