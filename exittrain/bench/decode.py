"""Decoding benchmark on the embedded target: our decoder beside Hugging Face's greedy and prompt lookup.

``python -m exittrain bench decode --drafter PATH [--sets code dialogue math restating] [--decode auto fixed]
[--budgets 16] [--prompts 10] [--skip 16] [--new-tokens 96] [--cache on off] [--head-layout auto linear]
[--packed on off] [--copy-tail 0 8] [--copy-chains latest both] [--copy-lead 0 4] [--draft-vocab 0 4096]
[--contexts 100 600]``

Side by side in one run, on the same held-out prompts and the same fp32 target, at temperature 0:

- Hugging Face ``model.generate(do_sample=False)``: plain greedy decoding, the baseline;
- Hugging Face prompt lookup, ``generate(do_sample=False, prompt_lookup_num_tokens=N)``: a free
  drafter that copies n-grams of the prompt and the text so far;
- with ``--decode fixed`` (the default), our :class:`~exittrain.cpu_decode.fast_products.FastCpuDecoder`
  (TEV) at each budget, with the drafter cache on and/or off (``--cache``; off is the full
  re-read, the reference twin), with the LM head in the layout timed fastest on this host and/or
  plain ``F.linear`` (``--head-layout auto linear``; :mod:`exittrain.cpu_decode.row_layouts`;
  ``linear`` is the reference twin), with the tree forward's linears packed for its rows where
  that times faster here and/or all through ``F.linear`` (``--packed on off``;
  :mod:`exittrain.cpu_decode.packed_linears`; ``off`` is the reference twin), and with each ``--copy-tail`` length
  (:mod:`exittrain.core.copy_tail`; 0 is off) with the chain of the latest n-gram match grafted,
  or the earliest match's as well (``--copy-chains latest both``), each
  ``--copy-lead`` n-gram length (copy-led rounds: where the root's last n tokens occurred
  before, the round verifies the copy alone, without the drafter; 0 is off) and each ``--draft-vocab`` size
  (:mod:`exittrain.cpu_decode.draft_vocab`, read from the drafter folder's ``draft_vocab.json``; 0
  is the whole vocabulary);
- with ``--decode auto``, our decoder at the setting :mod:`exittrain.cpu_decode.auto_settings`
  probes fastest on this host for each prompt set (budgets up to the largest of ``--budgets``, a
  draft vocabulary when the drafter folder has token counts, a copy tail of prompt lookup's
  length, copy-led rounds, or greedy decoding without the drafter when nothing beats it),
  probed on ``--probe-prompts`` other prompts of the set, taken in turn with the measured ones
  from the same stretch of the set (:func:`interleaved_split`: the measured prompts are then
  ``--skip``, ``--skip`` + 2, ...), so the choice is not tuned on the prompts it is timed on but
  on the same kind of text. The probe's reason is printed with the table.

The prompt sets (``--sets``), each reported in its own table: ``code``, ``dialogue``, ``math``,
the domain's evaluation prompts (HumanEval, MT-Bench, gsm_symbolic with the
evaluation seed) from ``--skip`` on (``fit`` decodes the first ones); and ``restating``, built
from the same HumanEval prompts (never a training prompt: the code recipe trains on CodeI/O),
each wrapped as :data:`RESTATE_INSTRUCTION` asks, so that the answer repeats the prompt's
signature and docstring at length before completing it: the case where copying pays most, and
where prompt lookup is at its best.

The methods take turns prompt by prompt, so a machine whose load drifts slows them alike; the
ratios (tokens/s over greedy, over prompt lookup) are the figures to compare, not the absolute
times. Our rows also give tau, the per-round stage times (draft, tree, target, verify, commit;
``perf_counter`` laps with an accelerator sync) and whether the tokens equal greedy ``generate``'s.

A drafter micro-benchmark then times one round's drafter work at each of ``--contexts`` tokens of
context (a real text: the code evaluation prompts concatenated): the full re-read (project every
context position, then draft), and the cache (project the ``--round-positions`` positions a round
commits, then draft over the cached K/V). The drafter's context window, when it has one, bounds
both. The output names the host: CPU model, ``torch.backends.cpu.get_cpu_capability()`` and
threads. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from exittrain import progress as progress_log
from exittrain.cpu_decode.auto_settings import AutoChoice, auto_decoder
from exittrain.cpu_decode.decode_settings import DecodeSetting
from exittrain.cpu_decode.draft_vocab import load_draft_vocabulary, load_token_counts
from exittrain.cpu_decode.fast_products import FastCpuDecoder
from exittrain.cpu_decode.packed_linears import packed_choices
from exittrain.cpu_decode.row_layouts import layout_choices
from exittrain.decoding import ROUND_PARTS
from exittrain.decoding.drafter_context import drafter_context
from exittrain.decoding.speculative import rounds_by_kind
from exittrain.tables import markdown_table, write_results


def host() -> dict:
    """The machine the figures come from: CPU model, its bf16 and AMX flags, torch's CPU capability,
    threads, torch version."""
    from exittrain.precision import bf16_units, cpu_model

    return {
        "cpu_model": cpu_model(),
        "cpu_units": bf16_units() or "none",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def host_line(h: dict) -> str:
    """One line naming the host of a :func:`host` record (records written before ``cpu_units`` read "?")."""
    return (f"{h['cpu_model']} (bf16/AMX flags: {h.get('cpu_units', '?')}), capability {h['cpu_capability']}, "
            f"{h['threads']} threads, torch {h['torch']}")


SETS = ("code", "dialogue", "math", "restating")
# the restating set: a HumanEval prompt (a signature and a docstring) inside this request, so the
# answer restates the prompt's code before it completes it
RESTATE_INSTRUCTION = (
    "Rewrite the following Python function in full: repeat its signature and its whole docstring "
    "word for word, add type hints, then complete its body.\n\n```python\n{prompt}\n```"
)


def check_sets(sets) -> None:
    """ValueError naming ``--sets`` unless it is a non-empty list of :data:`SETS`."""
    if not sets or any(name not in SETS for name in sets):
        raise ValueError(f"--sets {list(sets)}: choose among {list(SETS)}")


def restating_request(text: str) -> str:
    """:data:`RESTATE_INSTRUCTION` around the code of an evaluation text: the fenced block when the
    text has one (the code domain's texts ask "Complete the following Python function" around it),
    else the whole text."""
    fence = re.search(r"```(?:python)?\n(.*?)```", text, flags=re.DOTALL)
    code = (fence.group(1) if fence else text).strip("\n")
    return RESTATE_INSTRUCTION.format(prompt=code)


def _recipe_prompts(target, domain: str, n: int, skip: int) -> list[list[int]]:
    """``+recipe=<domain>``'s held-out prompts ``skip .. skip + n`` (the one loader the benches share)."""
    import tempfile

    from exittrain.bench.recipe import compose_fit_config, heldout_prompts

    with tempfile.TemporaryDirectory() as out:  # the composed config's run folder: nothing is written there
        return heldout_prompts(compose_fit_config(domain, Path(out)), target, n, skip=skip)


def set_prompts(target, name: str, n: int, skip: int) -> list[list[int]]:
    """The prompts ``skip .. skip + n`` of a set (:data:`SETS`), chat-templated as in training.

    ``code``, ``dialogue``, ``math``: the recipe's evaluation prompts, as ``fit`` and ``eval`` read them
    (:func:`exittrain.bench.recipe.heldout_prompts`).
    ``restating``: the code domain's evaluation texts (HumanEval), their code wrapped in
    :data:`RESTATE_INSTRUCTION` (:func:`restating_request`).
    """
    if name != "restating":
        return _recipe_prompts(target, name, n, skip)
    from exittrain.data import ExitTrainDataModule
    from exittrain.data.generation import chat_prompt_ids

    data = ExitTrainDataModule("code", tokenizer=target.tokenizer, progress=False)
    texts = data.plan.eval_texts(skip + n)[skip:]
    if not texts:
        raise ValueError(f"--skip {skip} leaves no HumanEval prompt for the restating set; lower --skip")
    system = data.plan.generation.system_prompt
    return [chat_prompt_ids(target.tokenizer, restating_request(t), system) for t in texts]


def interleaved_split(items: list, first: int, second: int) -> tuple[list, list]:
    """Two disjoint lists taken in turn from the head of ``items``: ``first[0], second[0],
    first[1], ...``; once one holds its count the other takes the next items.

    Why: ``--decode auto`` probes on ``second`` and is measured on ``first``. A set in the order it
    ships (MT-Bench by category, HumanEval by task) changes from one stretch to the next, so a
    probe on the prompts after the measured ones chose for other text (one dialogue drafter: tau
    1.82 on those, 1.41 on the measured ones). Taken in turn, both come from the same stretch.
    """
    if first < 0 or second < 0 or first + second > len(items):
        raise ValueError(f"cannot take {first} + {second} items from {len(items)}: fewer prompts, or a lower --skip")
    a, b = [], []
    for item in items[: first + second]:
        (a if len(a) < first and (len(a) <= len(b) or len(b) >= second) else b).append(item)
    return a, b


def hf_generate(target, prompt: list[int], new_tokens: int, **extra) -> tuple[list[int], float]:
    """(new tokens, seconds) of Hugging Face ``generate`` at temperature 0 (``extra``: e.g. prompt lookup)."""
    ids = torch.tensor([prompt], device=target.device)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
        eos_token_id=target.eos_token_ids, pad_token_id=target.eos_token_id or 0, **extra,
    )
    sync()
    return out[0, len(prompt):].tolist(), time.perf_counter() - start


def _summary(tokens: list[list[int]], seconds: list[float]) -> dict:
    count, total = sum(map(len, tokens)), sum(seconds)
    return {"tokens": count, "seconds": total, "tokens_per_s": count / total}


@torch.no_grad()
def drafter_round_ms(target, drafter, text: list[int], contexts: list[int], round_positions: int,
                     reps: int = 5) -> list[dict]:
    """Median ms of one round's drafter work at each context length, full re-read and cached."""
    layers = list(drafter.config.target_layer_ids)
    need = max(contexts) + 1
    if len(text) < need:
        raise ValueError(f"the micro-benchmark needs a text of {need} tokens, got {len(text)}; lower --contexts")
    ids = torch.tensor([text[:need]], device=target.device)
    features = target.prefill(ids, layers=layers).features  # (1, need, F)
    rows = []
    for C in contexts:
        n = min(round_positions, C - 1)
        root = ids[:, C]
        timed = {}
        for cached in (False, True):
            laps = []
            for _ in range(reps + 1):  # the first is a warm-up
                # a context holding C - n positions, then one round: n positions committed, one block drafted
                context = drafter_context(drafter, features[:, : C - n], ids[:, : C - n], cached=cached)
                start = time.perf_counter()
                context.extend(features[:, C - n : C], ids[:, C - n : C])
                context.draft(root)
                laps.append(time.perf_counter() - start)
            timed["cached" if cached else "full"] = 1e3 * statistics.median(laps[1:])
        rows.append({"context": C, "full_ms": timed["full"], "cached_ms": timed["cached"],
                     "speedup": timed["full"] / timed["cached"]})
    return rows


def _fixed_decoders(target, drafter, drafter_path, budgets, caches, head_layouts, copy_tails, vocab_sizes,
                    copy_leads=(0,), copy_earliest=(False,), miss_steps=(0,), packed=(True,)) -> list:
    """``(row settings, decoder)`` for every combination of the fixed grid (the copy chains vary
    only where there is a copy tail). A row's products are its decoder's options: head layout
    ``auto`` (head_rows picks) or ``linear`` (F.linear, the reference twin); ``packed`` True
    (packed linears where kept) or False (F.linear, the twin)."""
    vocabs = {n: load_draft_vocabulary(drafter_path, n, target) for n in vocab_sizes}
    return [({"budget": b, "drafter_cache": c, "head_layout": h, "packed": k, "copy_tail": t, "draft_vocab": n,
              "copy_lead": m, "copy_earliest": e, "miss_steps": st, "auto": False},
             FastCpuDecoder(target, drafter, budget=b, verifier="tev", drafter_cache=c, copy_tail=t,
                            draft_vocab=vocabs[n], copy_lead=m, copy_earliest=e, miss_steps=st,
                            head_layouts=h == "auto", packed=k))
            for b in budgets for c in caches for h in head_layouts for k in packed for t in copy_tails
            for n in vocab_sizes for m in copy_leads for e in (copy_earliest if t else copy_earliest[:1])
            for st in miss_steps]


def _auto_decoder(target, drafter, drafter_path, probe_prompts, max_budget: int,
                  new_tokens: int) -> tuple[dict, FastCpuDecoder, AutoChoice]:
    """``(row settings, decoder, choice)`` at the setting the probe finds fastest on ``probe_prompts``,
    whose answers it scores as long as the bench decodes them (``new_tokens``)."""
    counts = load_token_counts(drafter_path) if drafter_path else None
    decoder, choice = auto_decoder(target, drafter, probe_prompts, max_budget=max_budget, token_counts=counts,
                                   answer_tokens=new_tokens)
    s = choice.setting
    meta = {"budget": s.budget, "drafter_cache": True, "head_layout": "auto", "packed": True, "copy_tail": s.copy_tail,
            "draft_vocab": s.draft_vocab, "copy_lead": s.copy_lead, "miss_steps": s.miss_steps, "auto": True}
    return meta, decoder, choice


def _measure_set(target, prompts, decoders, new_tokens: int, lookup_tokens: int, name: str) -> dict:
    """Greedy, prompt lookup and each decoder on ``prompts``, taking turns per prompt; the set's table rows."""
    lookup = {"prompt_lookup_num_tokens": lookup_tokens}
    # warm-up: one short decode of each kind so lazy initialisation is not timed
    hf_generate(target, prompts[0], 4)
    hf_generate(target, prompts[0], 4, **lookup)
    for _, decoder in decoders:
        decoder.generate(prompts[0], 4)

    greedy, plookup = ([], []), ([], [])
    ours: list[list] = [[] for _ in decoders]
    ticker = progress_log.Ticker(f"bench decode {name}", len(prompts), unit="prompt", every=1)
    for done, prompt in enumerate(prompts, 1):  # methods take turns per prompt: a drifting load slows all alike
        for store, extra in ((greedy, {}), (plookup, lookup)):
            tokens, seconds = hf_generate(target, prompt, new_tokens, **extra)
            store[0].append(tokens)
            store[1].append(seconds)
        for results, (_, decoder) in zip(ours, decoders):
            results.append(decoder.generate(prompt, new_tokens, temperature=0.0))
        ticker.update(done, greedy_s=f"{sum(greedy[1]):.0f}", lookup_s=f"{sum(plookup[1]):.0f}",
                      ours_s=" ".join(f"{sum(r.seconds for r in v):.0f}" for v in ours))
    base, pl = _summary(*greedy), _summary(*plookup)
    pl["vs_greedy"] = pl["tokens_per_s"] / base["tokens_per_s"]
    pl["equals_greedy"] = sum(a == b for a, b in zip(plookup[0], greedy[0]))
    rows = []
    for (meta, _), results in zip(decoders, ours):
        rounds = [r for res in results for r in res.rounds]
        stage = {s: sum(r.times.get(s, 0.0) for r in rounds) for s in ROUND_PARTS}
        summary = _summary([r.tokens for r in results], [r.seconds for r in results])
        rows.append({
            **meta,
            "nodes_per_round": sum(r.tree_nodes for r in rounds) / len(rounds),
            "tau": sum(r.block_length for r in rounds) / len(rounds),
            **summary,
            "vs_greedy": summary["tokens_per_s"] / base["tokens_per_s"],
            "vs_prompt_lookup": summary["tokens_per_s"] / pl["tokens_per_s"],
            "ms_per_round": 1e3 * sum(stage.values()) / len(rounds),
            "stage_ms_per_round": {s: 1e3 * v / len(rounds) for s, v in stage.items()},
            "round_kinds": rounds_by_kind(rounds),  # what auto priced each kind at can be checked against it
            "equals_greedy": sum(r.tokens == g for r, g in zip(results, greedy[0])),
        })
    return {"name": name, "prompts": len(prompts), "greedy": base, "prompt_lookup": pl, "rows": rows}


def run(drafter_path: str | None, budgets: list[int], n_prompts: int, skip: int, new_tokens: int,
        sets: list[str] = ("code",), caches: list[bool] = (True,), lookup_tokens: int = 10,
        contexts: list[int] | None = None, round_positions: int = 4, head_layouts: list[str] = ("auto",),
        copy_tails: list[int] = (0,), vocab_sizes: list[int] = (0,), decode: list[str] = ("fixed",),
        probe_prompts: int = 8, copy_leads: list[int] = (0,), copy_earliest: list[bool] = (False,),
        miss_steps: list[int] = (0,), packed: list[bool] = (True,)) -> dict:
    from exittrain.models import load_drafter, load_target, new_drafter

    check_sets(sets)
    target = load_target(None)
    drafter = (load_drafter(drafter_path, target) if drafter_path else new_drafter(target, seed=0)).eval()
    fixed = (_fixed_decoders(target, drafter, drafter_path, budgets, caches, head_layouts, copy_tails, vocab_sizes,
                             copy_leads, copy_earliest, miss_steps, packed) if "fixed" in decode else [])
    measured = []
    for name in sets:
        decoders = list(fixed)
        choice = None
        if "auto" in decode:  # probed on other prompts of the same stretch: not tuned on what it is timed on
            stretch = set_prompts(target, name, n_prompts + probe_prompts, skip)
            prompts, probe = interleaved_split(stretch, n_prompts, probe_prompts)
            indices, _ = interleaved_split(list(range(skip, skip + len(stretch))), n_prompts, probe_prompts)
            meta, decoder, choice = _auto_decoder(target, drafter, drafter_path, probe, max(budgets), new_tokens)
            decoders.append((meta, decoder))
            print(f"{name}: {choice.reason}")
        else:
            prompts = set_prompts(target, name, n_prompts, skip)
            indices = list(range(skip, skip + len(prompts)))
        result = _measure_set(target, prompts, decoders, new_tokens, lookup_tokens, name)
        result["prompt_indices"] = indices
        if choice is not None:
            result["auto"] = choice.to_dict()
        measured.append(result)
    text = [t for p in _recipe_prompts(target, "code", 64, 0) for t in p]
    micro = drafter_round_ms(target, drafter, text, contexts or [100, 600], round_positions)
    return {"host": host(), "skip": skip, "new_tokens": new_tokens, "drafter": drafter_path or "fresh",
            "context_window": drafter.config.context_window, "lookup_tokens": lookup_tokens, "sets": measured,
            "round_positions": round_positions, "drafter_round": micro, "head_layout": layout_choices(),
            "packed_buckets": packed_choices(target.model)}


def _row_label(r: dict) -> str:
    if r.get("auto"):
        setting = DecodeSetting(r["budget"], r.get("draft_vocab", 0), r.get("copy_tail", 0), r.get("copy_lead", 0),
                                r.get("miss_steps", 0))
        return f"ours auto: {setting.label}"
    return (f"ours B={r['budget']}, drafter cache {'on' if r['drafter_cache'] else 'off'}, "
            f"head {r.get('head_layout', 'linear')}" + ("" if r.get("packed", True) else ", linears F.linear")
            + (f", copy tail {r['copy_tail']}" if r.get("copy_tail") else "")
            + (", both copy chains" if r.get("copy_tail") and r.get("copy_earliest") else "")
            + (f", draft vocab {r['draft_vocab']}" if r.get("draft_vocab") else "")
            + (f", copy lead {r['copy_lead']}" if r.get("copy_lead") else "")
            + (f", miss steps {r['miss_steps']}" if r.get("miss_steps") else ""))


def set_table(result: dict, measured: dict) -> list[str]:
    """One prompt set's lines: a heading, the methods' table, and the auto probe's reason."""
    g, pl, n = measured["greedy"], measured["prompt_lookup"], measured["prompts"]
    indices = measured.get("prompt_indices") or list(range(result["skip"], result["skip"] + n))
    where = (f"#{indices[0]}-#{indices[-1]}" if indices == list(range(indices[0], indices[0] + n))
             else "#" + ", #".join(map(str, indices)))
    heading = f"### {measured['name']}: {n} held-out prompts ({where}) x {result['new_tokens']} tokens"
    lines = [heading, ""]
    dash = ["-"] * len(ROUND_PARTS)
    rows = [
        ["HF greedy generate", "1.00", "-", f"{g['tokens_per_s']:.1f}", "1.00x", "-", f"{n}/{n}", "-", *dash],
        [f"HF prompt lookup ({result['lookup_tokens']})", "-", "-", f"{pl['tokens_per_s']:.1f}",
         f"{pl['vs_greedy']:.2f}x", "1.00x", f"{pl['equals_greedy']}/{n}", "-", *dash],
    ]
    for r in measured["rows"]:
        rows.append([
            _row_label(r), f"{r['tau']:.2f}", f"{r['nodes_per_round']:.1f}" if "nodes_per_round" in r else "-",
            f"{r['tokens_per_s']:.1f}", f"{r['vs_greedy']:.2f}x", f"{r['vs_prompt_lookup']:.2f}x",
            f"{r['equals_greedy']}/{n}", f"{r['ms_per_round']:.1f}",
            *(f"{r['stage_ms_per_round'][s]:.1f}" for s in ROUND_PARTS),
        ])
    lines += markdown_table(
        ["method", "tau", "nodes/round", "tok/s", "vs greedy", "vs prompt lookup", "= greedy", "ms/round",
         *(f"{s} ms" for s in ROUND_PARTS)], rows,
    )
    mixed = [r for r in measured["rows"] if len(r.get("round_kinds", {})) > 1]
    if mixed:  # what each kind of round cost and yielded, where a decoder ran more than one kind
        lines += [""] + [f"Rounds of {_row_label(r)}: " + "; ".join(
            f"{kind} {k['rounds']} at {k['ms']:.0f} ms, tau {k['block_length']:.2f}"
            for kind, k in r["round_kinds"].items()) + "." for r in mixed]
    if measured.get("auto"):
        lines += ["", f"Probe: {measured['auto']['reason']}."]
    return lines


def to_markdown(result: dict) -> str:
    h = result["host"]
    lines = [
        f"Host: {host_line(h)}. "
        f"Target: the embedded SmolLM2-135M-Instruct in fp32. Drafter: {result['drafter']} (context window "
        f"{result['context_window']}). T = 0; methods take turns per prompt, so compare the ratios.",
    ]
    for measured in result["sets"]:
        lines += ["", *set_table(result, measured)]
    lines += [
        "",
        f"Drafter work of one round ({result['round_positions']} newly committed positions, one block), median ms:",
        "",
        *markdown_table(
            ["context tokens", "full re-read ms", "cached ms", "ratio"],
            ([r["context"], f"{r['full_ms']:.1f}", f"{r['cached_ms']:.1f}", f"{r['speedup']:.1f}x"]
             for r in result["drafter_round"]),
        ),
    ]
    if result.get("head_layout"):
        lines += ["", "LM head layout chosen on this host (row_matmul.head_rows, the median of timed calls per row "
                  "count; a tree forward's head runs packed instead where a packed bucket is kept):", "",
                  *markdown_table(["rows", "weight (V x H)", "F.linear ms", "W @ x.T ms", "chosen"],
                                  ([c["rows"], " x ".join(map(str, c.get("weight", ["?"]))), f"{c['linear_ms']:.1f}",
                                    f"{c['transposed_ms']:.1f}", c["layout"]]
                                   for c in result["head_layout"]))]
    return "\n".join(lines + packed_lines(result.get("packed_buckets"))) + "\n"


def packed_lines(buckets: list[dict] | None) -> list[str]:
    """The table of the target's packed row buckets (``PackedLinears.choices()``), or nothing."""
    if not buckets:
        return []
    return ["", "Row buckets of the target's packed linears (exittrain.cpu_decode.packed_linears; every linear once, "
            "median ms, on the fewest rows the bucket serves, padded up for the packed product):", "",
            *markdown_table(["bucket", "timed on rows", "F.linear ms", "packed ms", "kept"],
                            ([b["rows"], b.get("timed_rows", b["rows"]), f"{b['linear_ms']:.1f}",
                              f"{b['packed_ms']:.1f}", "yes" if b["packed"] else "no"] for b in buckets))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="saved drafter folder (default: a fresh drafter)")
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=["code"],
                        help="prompt sets, one table each: the domains' held-out prompts, and restating (HumanEval "
                             "prompts asking to repeat the code at length)")
    parser.add_argument("--decode", nargs="+", choices=["fixed", "auto"], default=["fixed"],
                        help="fixed: the grid of --budgets/--cache/--head-layout/--copy-tail/--copy-lead/"
                             "--miss-steps/--draft-vocab; auto: the setting the probe finds fastest here per set "
                             "(budgets up to max(--budgets))")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--skip", type=int, default=16, help="evaluation prompts to leave out first (fit decodes them)")
    parser.add_argument("--probe-prompts", type=int, default=8,
                        help="prompts of each set, taken in turn with the measured ones, for the auto probe")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--cache", nargs="+", choices=["on", "off"], default=["on"],
                        help="decode with the drafter cache on, off (the full re-read), or both")
    parser.add_argument("--head-layout", nargs="+", choices=["auto", "linear"], default=["auto"],
                        help="the LM head in the layout timed fastest here (auto), plain F.linear, or both")
    parser.add_argument("--packed", nargs="+", choices=["on", "off"], default=["on"],
                        help="tree forwards' linears packed for their rows where that times faster here (on), "
                             "F.linear (off), or both")
    parser.add_argument("--copy-tail", type=int, nargs="+", default=[0],
                        help="copy tail lengths to decode with (0: off; SpeculativeDecoder(copy_tail=))")
    parser.add_argument("--copy-chains", nargs="+", choices=["latest", "both"], default=["latest"],
                        help="the copy tail's chains: the latest n-gram match's (latest), or the earliest match's "
                             "as well (both; SpeculativeDecoder(copy_earliest=True))")
    parser.add_argument("--copy-lead", type=int, nargs="+", default=[0],
                        help="copy-led rounds on n-gram matches of these lengths (0: off; "
                             "FastCpuDecoder(copy_lead=))")
    parser.add_argument("--miss-steps", type=int, nargs="+", default=[0],
                        help="steps of the root alone after a drafted round that accepted nothing, at most this "
                             "many in a row (0: off; FastCpuDecoder(miss_steps=))")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[0],
                        help="draft vocabulary sizes (0: every token; else the drafter folder's draft_vocab.json)")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of the baseline")
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 600],
                        help="context lengths of the drafter micro-benchmark")
    parser.add_argument("--round-positions", type=int, default=4,
                        help="positions one round commits in the drafter micro-benchmark")
    parser.add_argument("--out", default="results/bench_decode")
    args = parser.parse_args(argv)
    result = run(args.drafter, args.budgets, args.prompts, args.skip, args.new_tokens,
                 sets=list(dict.fromkeys(args.sets)), caches=[c == "on" for c in dict.fromkeys(args.cache)],
                 lookup_tokens=args.lookup_tokens, contexts=args.contexts, round_positions=args.round_positions,
                 head_layouts=list(dict.fromkeys(args.head_layout)), copy_tails=list(dict.fromkeys(args.copy_tail)),
                 vocab_sizes=list(dict.fromkeys(args.draft_vocab)), decode=list(dict.fromkeys(args.decode)),
                 probe_prompts=args.probe_prompts, copy_leads=list(dict.fromkeys(args.copy_lead)),
                 copy_earliest=[c == "both" for c in dict.fromkeys(args.copy_chains)],
                 miss_steps=list(dict.fromkeys(args.miss_steps)),
                 packed=[k == "on" for k in dict.fromkeys(args.packed)])
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
