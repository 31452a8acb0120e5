"""Sizes and the memory model of a plan: bytes parsed and printed, the counted :class:`Item`, the
phases of a :class:`Step`, the :class:`Shapes` the model reads, what each step kind keeps alive, the
rank's persistent state, the data and the schedule (see the shape legend of :mod:`exittrain.plan`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# sizes


def parse_size(text: str, key: str = "--device-memory") -> int:
    """Bytes of ``80GiB``, ``80GB``, ``24 GiB``, ``512MiB`` (decimal KB/MB/GB/TB, binary KiB/MiB/GiB/TiB).

    ValueError naming ``key`` for anything else, a bare number included (GB or GiB is ambiguous)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{key}={text!r}: give a size with its unit, e.g. 80GiB, 24GiB, 80GB or 512MiB")
    unit = match.group(2).lower()
    size = float(match.group(1)) * _SIZE_UNITS[unit]
    if size <= 0:
        raise ValueError(f"{key}={text!r}: need a size > 0, e.g. 80GiB")
    return int(size)


def human(n: float | None) -> str:
    """``n`` bytes as ``12.3 GiB`` / ``512 MiB`` / ``3 KiB``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{1 if abs(n) / size < 100 else 0}f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Item:
    """One counted tensor (or group of tensors): its ``name``, how it is computed, and its bytes."""

    name: str
    formula: str
    bytes: int


@dataclass
class Step:
    """One step kind of a stage, per rank: ``phases`` maps a phase to what is alive in it (the
    rank's persistent state included); ``peak`` is the largest phase."""

    stage: str
    kind: str
    phases: dict[str, list[Item]]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(i.bytes for i in self.phases[p]))

    @property
    def items(self) -> list[Item]:
        return self.phases[self.peak_phase]

    @property
    def peak(self) -> int:
        return sum(i.bytes for i in self.items)



# ----------------------------------------------------------------------------------------------
# the memory model


@dataclass(frozen=True)
class Shapes:
    """Every size the memory model reads (see the module's shape legend)."""

    V: int
    H: int
    I: int  # noqa: E741
    layers: int
    heads: int
    kv: int
    hd: int
    st: int  # target weight bytes
    D: int
    Id: int
    d_layers: int
    d_heads: int
    d_kv: int
    d_hd: int
    S: int
    F: int
    copy: bool
    pb: int  # drafter parameter bytes
    autocast: bool

    @property
    def K(self) -> int:
        return self.S - 1

    @property
    def sa(self) -> int:
        """Bytes of an activation of a matmul: 2 under autocast, else the weights'."""
        return 2 if self.autocast else self.pb

    @property
    def sta(self) -> int:
        """Bytes of a target activation (logits, hidden states) in a training step."""
        return 2 if self.autocast else self.st

    def kv_bytes(self, L: int, n: int, s: int | None = None) -> int:
        """K and V of every target layer over L x n positions."""
        return self.layers * 2 * L * n * self.kv * self.hd * (self.st if s is None else s)

    def target_layer_rows(self, rows: int, s: int | None = None) -> int:
        """~ one target layer's live activations per row: 6 hidden-size, 5 MLP-size and twice the Q/K/V
        widths (rotary copies). Calibrated: SmolLM2's decoder over 520 rows on a CPU grew the resident
        memory by 27.7 MB, this gives 27 MB."""
        width = 6 * self.H + 5 * self.I + 2 * (self.heads + 2 * self.kv) * self.hd
        return rows * width * (self.sta if s is None else s)

    def repeated_kv(self, L: int, n: int) -> int:
        """K and V of one layer repeated to every query head (transformers' sdpa path repeats
        grouped-query K/V whenever an attention mask is given)."""
        return 2 * L * n * self.heads * self.hd * self.st if self.kv < self.heads else 0


def _draft_activations(s: Shapes, L: int, T: int, A: int, grad: bool) -> list[Item]:
    """~ the drafter's layer activations (kept for backward with ``grad``, one layer's otherwise)."""
    rows_c, rows_b = L * T, L * A * s.S
    q, kvw = s.d_heads * s.d_hd, s.d_kv * s.d_hd
    ctx = rows_c * s.D * (s.sa + 8)
    per_ctx = rows_c * kvw * (2 * s.sa + 16) + 2 * L * (T + A * s.S) * kvw * s.sa
    per_blk = rows_b * (s.D * (2 * s.sa + 16) + q * (2 * s.sa + 16) + kvw * (2 * s.sa + 16) + 4 * s.Id * s.sa)
    n = s.d_layers if grad else 1
    return [
        Item("drafter context rows", f"~ L*T*D*({s.sa}+8) (fc, hidden_norm)", ctx),
        Item(f"drafter layer activations ({n} layer{'s' * (n > 1)})",
             f"~ {n} x [L*T ctx K/V + L*A*S*(norms, Q/K/V, attn, 4*MLP)] @ {s.sa} B", n * (per_ctx + per_blk)),
    ]  # fmt: skip


def _scoring_phase(s: Shapes, L: int, T: int, A: int, B: int, chunk: int | None, mode: str, window: int) -> list[Item]:
    """What tree scoring holds at its peak (:meth:`TargetModel.score_trees`)."""
    B1, V, N = B + 1, s.V, L * A
    result = Item("tree logits, returned", f"N*(B+1)*V*{s.sta} = {N}*{B1}*{V}*{s.sta}", N * B1 * V * s.sta)
    if mode == "windowed":
        n = min(chunk or N, N)
        rows = n * (window + B1)
        items = [
            Item("windowed rows' K/V", f"layers*2*c*(W+B+1)*kv*hd*{s.st}", s.kv_bytes(1, rows)),
            Item("attention mask", f"c*(W+B+1)^2*({s.st}+1)", n * (window + B1) ** 2 * (s.st + 1)),
            Item("one target layer (window + tree rows)", "~ c*(W+B+1) rows", s.target_layer_rows(rows)),
            result,
        ]
        if n < N:
            items.append(Item("one chunk's logits", f"c*(B+1)*V*{s.sta} = {n}*{B1}*{V}*{s.sta}", n * B1 * V * s.sta))
        return items
    c = min(chunk or A, A)
    Q = c * B1
    items = [
        Item("prefix K/V (causal pass)", f"layers*2*L*T*kv*hd*{s.st} = {s.layers}*2*{L}*{T}*{s.kv}*{s.hd}*{s.st}",
             s.kv_bytes(L, T)),
        Item("prefix + chunk K/V (one forward's cache)", f"layers*2*L*(T+c*(B+1))*kv*hd*{s.st}, c = {c}",
             s.kv_bytes(L, T + Q)),
        Item("tree attention mask", f"L*c*(B+1)*(T+c*(B+1))*({s.st}+1)", L * Q * (T + Q) * (s.st + 1)),
        Item("one target layer (chunk rows)", f"~ L*c*(B+1) = {L * Q} rows", s.target_layer_rows(L * Q)),
        Item("one layer's K/V repeated to all heads", f"2*L*(T+c*(B+1))*heads*hd*{s.st}", s.repeated_kv(L, T + Q)),
        result,
    ]
    if c < A:
        items.append(Item("one chunk's logits", f"L*c*(B+1)*V*{s.sta} = {L}*{c}*{B1}*{V}*{s.sta}", L * Q * V * s.sta))
    return items


def step(s: Shapes, base: list[Item], a: dict, L: int, T: int, *, stage: str, kind: str) -> Step:
    """The phases of one step kind (``kind``: train or val) of ``stage`` with module arguments ``a``."""
    A, B, V, K = a["anchors_per_seq"], a["budget"], s.V, s.K
    N, e = L * A, L * A * K * V
    grad = kind == "train"
    exit_loss = grad and stage == "exittrain"
    metrics = not grad or stage == "exittrain" or (a.get("analytic_every") or 0) > 0
    sampled = grad and not exit_loss and a.get("vocab_sample") is not None
    soft = a.get("soft_label_weight", 0) > 0 and grad
    cache = a.get("feature_cache", False)

    batch = [Item("batch token ids and masks", "L*T*(8+1+1)", L * T * 10)]
    if cache:
        batch.append(Item("batch features (feature store, bf16)", f"L*T*F*2 = {L}*{T}*{s.F}*2", L * T * s.F * 2))
    if soft:
        k = a.get("soft_label_top_k", 16)
        batch.append(Item("batch soft labels (ids, log-probs, on device)", f"L*T*k*(4+4+8+4), k = {k}", L * T * k * 20))
    features = Item("target features fp32", f"L*T*F*4 = {L}*{T}*{s.F}*4", L * T * s.F * 4)
    phases: dict[str, list[Item]] = {}
    if not cache:
        phases["target features"] = base + batch + [
            Item("one target layer (causal pass)", f"~ L*T = {L * T} rows", s.target_layer_rows(L * T)),
            Item("captured layers, concatenated", f"2*L*T*F*{s.sta}", 2 * L * T * s.F * s.sta),
            features,
        ]
    alive = base + batch + [features] + _draft_activations(s, L, T, A, grad)
    if s.autocast and s.st > 2:  # autocast casts the fp32 head weight for each product with it
        head_copy = [Item("autocast bf16 copy of the target's LM head", f"V*H*2 = {V}*{s.H}*2", V * s.H * 2)]
    else:
        head_copy = []
    if sampled:
        C = min(V, a["vocab_sample"] + N * K * (a.get("soft_label_top_k", 16) if soft else 1))
        n = (s.sa + 8 + (8 if s.copy else 0)) * N * K * C
        kept = [Item("sampled logits and log-probs", f"N*K*C*({s.sa}+8{'+8' if s.copy else ''}), C = {C}", n)]
        phases["drafter forward"] = alive + kept
        phases["backward"] = alive + kept + [Item("their gradients", "N*K*C*8", N * K * C * 8)]
        if not metrics:
            return Step(stage, kind, phases)
        alive = alive + kept + [Item("drafter logits (metrics, no grad)", f"N*K*V*4 = {N}*{K}*{V}*4", e * 4)]
    else:
        if s.copy:
            out = Item("drafter log-probs (log_softmax, copy mix)" if grad else "drafter log-probs (copy mix)",
                       f"N*K*V*{8 if grad else 4} = {N}*{K}*{V}*{8 if grad else 4}", e * (8 if grad else 4))
            cast = 4 if s.sta != 4 else 0  # copy_logits: log_softmax(logits.float())
            head = [Item("head logits, their fp32 cast and the copy mix (transient)",
                         f"N*K*V*({s.sta}+{cast}+4)", e * (s.sta + cast + 4))]  # fmt: skip
        else:
            out = Item("drafter logits", f"N*K*V*{s.sta} = {N}*{K}*{V}*{s.sta}", e * s.sta)
            head = []
        ce = [Item("block CE log-probs (kept for backward)", f"N*K*V*4 = {N}*{K}*{V}*4", e * 4)] if grad else []
        phases["drafter forward"] = alive + [out] + head + ce + head_copy
        alive = alive + [out] + ce
        if not metrics:
            phases["backward"] = alive + [Item("gradients of N*K*V tensors", "N*K*V*8", e * 8)]
            return Step(stage, kind, phases)
    phases["tree scoring"] = alive + head_copy + _scoring_phase(
        s, L, T, A, B, a.get("score_chunk_size"), a.get("scoring", "exact"), a.get("window", 64)
    )
    Rn, B1 = N * (B + 1) * V, B + 1
    result = Item("tree logits, returned", f"N*(B+1)*V*{s.sta} = {N}*{B1}*{V}*{s.sta}", Rn * s.sta)
    probs = Item("target probabilities fp32", f"N*(B+1)*V*4 = {N}*{B1}*{V}*4", Rn * 4)
    copies = Item("their index copy (and fp32 cast)", f"N*(B+1)*V*({s.sta}{'+4' if s.sta != 4 else ''})",
                  Rn * (s.sta + (4 if s.sta != 4 else 0)))
    phases["target probabilities"] = alive + [result, copies, probs]
    if exit_loss:
        node = Item("node loss log-probs and labels (kept), copy and product", "N*K*V*(8+8)", e * 16)
        phases["node loss"] = alive + [result, probs, node]
        kept = Item("node loss log-probs and labels (kept)", "N*K*V*8", e * 8)
        phases["backward"] = alive + [kept, Item("gradients of N*K*V tensors", "N*K*V*8", e * 8)]
    elif grad:
        phases["backward"] = alive + [Item("gradients of N*K*V tensors", "N*K*V*8", e * 8)]
    return Step(stage, kind, phases)


def persistent(s: Shapes, target_bytes: int, Pd: int, world: int, strategy: str, gpus: int) -> list[Item]:
    """The rank's state through every training step."""
    share = f" / {gpus} GPUs (device_map)" if gpus > 1 else ""
    items = [Item("target weights (frozen)", f"{target_bytes} B{share}", target_bytes // gpus)]
    shard = world if strategy == "fsdp" else 1
    tag = f" / W = {world} (FSDP)" if shard > 1 else ""
    items += [
        Item("drafter parameters", f"P_d*{s.pb}{tag} = {Pd}*{s.pb}", Pd * s.pb // shard),
        Item("drafter gradients", f"P_d*{s.pb}{tag}", Pd * s.pb // shard),
        Item("AdamW moments (exp_avg, exp_avg_sq)", f"P_d*2*{s.pb}{tag}", 2 * Pd * s.pb // shard),
    ]
    if strategy == "fsdp" and shard > 1:
        gathered = 2 * Pd * s.pb // s.d_layers
        items.append(Item("FSDP: gathered parameters of 2 layers", f"2*P_d/{s.d_layers}*{s.pb}", gathered))
    if s.autocast:
        items.append(Item("autocast bf16 copies of the drafter's weights", "P_d*2 (per step)", Pd * 2 // shard))
    if strategy == "ddp":
        items.append(Item("DDP gradient buckets", f"P_d*{s.pb}", Pd * s.pb))
    return items


def corpus_rows(cfg) -> int | None:
    """The corpus rows a run labels (``data.max_corpus_rows``): 0 without ``data.corpus_sources``, None when
    every row of the sources is taken (not counted from the config alone)."""
    if not cfg.data.get("corpus_sources"):
        return 0
    rows = cfg.data.get("max_corpus_rows")
    return None if rows is None else int(rows)


def data_items(s: Shapes, cfg, prompts: int | None, feature_cache: bool, top_k: int) -> list[Item]:
    """Host and disk bytes of the regenerated data (upper bounds: every answer max_new_tokens long) and of
    the corpus rows (upper bounds: every row max_length long, all of it answer but one token)."""
    if prompts is None:
        items = [Item("data", "data.max_train_prompts=null: every prompt of the sources, not counted here", 0)]
        answers = tokens = 0
    else:
        gen = cfg.data.generation
        new, prompt_max = int(gen.max_new_tokens), int(gen.get("max_prompt_tokens", 512))
        row = min(int(cfg.data.max_length), prompt_max + new)
        answers, tokens = prompts * new, prompts * row
        items = [
            Item("answer tokens (<=)", f"prompts*max_new_tokens = {prompts}*{new}", answers),
            Item("row tokens (<=)", f"prompts*min(max_length, max_prompt_tokens+max_new_tokens) = {prompts}*{row}",
                 tokens),
            Item("token columns on disk (<=)", "row tokens*(8+1)", tokens * 9),
        ]  # fmt: skip
    corpus, T = corpus_rows(cfg), int(cfg.data.max_length)
    c_tokens = c_answers = 0
    if corpus is None:
        items.append(Item("corpus rows", "data.max_corpus_rows=null: every row of data.corpus_sources, not counted", 0))
    elif corpus:
        c_tokens, c_answers = corpus * T, corpus * (T - 1)
        items += [
            Item("corpus row tokens (<=)", f"max_corpus_rows*max_length = {corpus}*{T}", c_tokens),
            Item("corpus token columns on disk (<=)", "corpus row tokens*(8+1)", c_tokens * 9),
        ]
    labels = (answers + c_answers) * top_k * 8
    features = (tokens + c_tokens) * s.F * 2 if feature_cache else 0
    what = "(answer tokens + corpus answer tokens)" if corpus else "answer tokens"
    rows = "(row tokens + corpus row tokens)" if corpus else "row tokens"
    items += [
        Item("soft labels (top-k ids int32 + log-probs fp32)",
             f"{what}*k*8, k = {top_k}" if top_k else "not kept (soft_label_weight=0)", labels),
        Item("target features (bf16)", f"{rows}*F*2, F = {s.F}" if feature_cache else
             f"not kept (feature_cache=false; they would be {rows}*F*2 = {human((tokens + c_tokens) * s.F * 2)})",
             features),
    ]  # fmt: skip
    host = labels + features if feature_cache else 0  # disk mode: each batch reads its rows
    how = "features + soft labels (feature_cache=true)" if feature_cache else "0: read per batch (feature_cache=false)"
    items.append(Item("host memory per process (feature store)", how, host))
    return items


def data_compute(cfg, target_params: int) -> dict[str, Any]:
    """What the data step asks of the target: its forwards, in sequence, and their FLOPs (2 x parameters x
    tokens, upper bounds as in :func:`data_items`). Answering prompts runs one forward per generated token of
    every batch; labelling corpus rows one forward per batch of rows (``TEACHER_FORCED_BATCH``), the whole
    row at once: a prefill, as parallel as the device allows."""
    from exittrain.data.brought import TEACHER_FORCED_BATCH

    gen, T = cfg.data.generation, int(cfg.data.max_length)
    prompts, corpus = cfg.data.get("max_train_prompts"), corpus_rows(cfg)
    out: dict[str, Any] = {}
    if prompts is not None:
        new, prompt_max = int(gen.max_new_tokens), int(gen.get("max_prompt_tokens", 512))
        batches = math.ceil(int(prompts) / int(gen.batch_size))
        out["data step: answering, target forwards in sequence (<=)"] = (
            f"batches*(1 + max_new_tokens) = {batches}*{1 + new} = {batches * (1 + new)}")
        flops = 2 * target_params * int(prompts) * (prompt_max + new)
        out["data step: answering, FLOPs (<=)"] = f"2*P_t*prompts*(max_prompt_tokens+max_new_tokens) = {flops:.3g}"
    if corpus:
        batches = math.ceil(corpus / TEACHER_FORCED_BATCH)
        out["data step: corpus labelling, target forwards (<=)"] = (
            f"ceil(max_corpus_rows/{TEACHER_FORCED_BATCH}) = {batches}, one prefill each")
        out["data step: corpus labelling, FLOPs (<=)"] = (
            f"2*P_t*max_corpus_rows*max_length = {2 * target_params * corpus * T:.3g}")
    elif corpus is None:
        out["data step: corpus labelling"] = "data.max_corpus_rows=null: every row, not counted here"
    return out


def schedule(cfg, stages: list[str], args: dict, world: int) -> dict:
    prompts = cfg.data.get("max_train_prompts")
    L, T, val = int(cfg.data.batch_size), int(cfg.data.max_length), float(cfg.data.val_fraction)
    out: dict[str, Any] = {"prompts (max_train_prompts)": prompts}
    if prompts is None:
        out["train rows"] = None
        rows = None
    else:
        held = max(1, round(val * prompts)) if val > 0 else 0
        rows = max(prompts - held, 0)
        out["train rows (<=)"] = f"{rows} (prompts - {held} validation)"
    per_rank = None if rows is None else math.ceil(rows / world)
    out["steps per epoch per rank (<=)"] = None if per_rank is None else math.ceil(per_rank / L)
    out["tokens per step, all ranks (<=)"] = f"L*W*T = {L}*{world}*{T} = {L * world * T}"
    for stage in stages:
        A, steps = args[stage]["anchors_per_seq"], int(cfg.stages[stage].max_steps)
        epochs = None if per_rank is None or not per_rank else steps / math.ceil(per_rank / L)
        out[f"{stage}: steps, epochs (>=)"] = f"{steps}, {'-' if epochs is None else f'{epochs:.1f}'}"
        out[f"{stage}: anchors per step, all ranks"] = L * world * A
        scored = stage == "exittrain" or (args[stage].get("analytic_every") or 0) > 0
        out[f"{stage}: tree rows scored per training step per rank"] = (
            L * A * (args[stage]["budget"] + 1) if scored else "0 (validation steps only)")
    return out
