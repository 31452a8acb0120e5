"""The decoding benchmark's pieces on a tiny target: the Hugging Face baselines, the drafter
micro-benchmark, the host line and the table."""

from __future__ import annotations

import pytest
import torch

from exittrain.bench import decode as bench_decode
from exittrain.bench.registry import BENCHES
from exittrain.cpu_decode.auto_settings import auto_decoder
from exittrain.decoding import ROUND_PARTS
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

PROMPT = [5, 17, 33, 2, 40, 41, 9, 12, 5, 17, 33]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3)


def test_decode_bench_is_registered():
    assert BENCHES["decode"] == "exittrain.bench.decode"


def test_prompt_lookup_baseline_decodes_greedy_tokens(target, monkeypatch):
    monkeypatch.setattr(target, "eos_token_ids", [])
    greedy, seconds = bench_decode.hf_generate(target, PROMPT, 20)
    lookup, _ = bench_decode.hf_generate(target, PROMPT, 20, prompt_lookup_num_tokens=4)
    assert len(greedy) == 20 and seconds > 0
    assert lookup == greedy
    with torch.no_grad():  # greedy's first token is the target's argmax after the prompt
        assert greedy[0] == int(target.model(input_ids=torch.tensor([PROMPT])).logits[0, -1].argmax())


def test_drafter_round_times_both_paths_at_each_context(target):
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, context_window=16).eval()
    text = list(range(2, 50))
    rows = bench_decode.drafter_round_ms(target, drafter, text, [10, 30], round_positions=3, reps=2)
    assert [r["context"] for r in rows] == [10, 30]
    assert all(r["full_ms"] > 0 and r["cached_ms"] > 0 for r in rows)
    with pytest.raises(ValueError, match="contexts"):
        bench_decode.drafter_round_ms(target, drafter, text[:20], [30], round_positions=3)


def test_host_names_the_cpu_and_its_capability():
    h = bench_decode.host()
    assert h["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert h["cpu_model"] and h["threads"] == torch.get_num_threads()


def test_markdown_has_one_table_per_set_with_the_baselines_our_rows_and_the_probe():
    stage = {s: float(i) for i, s in enumerate(ROUND_PARTS)}
    code = {
        "name": "code", "prompts": 2,
        "greedy": {"tokens_per_s": 10.0},
        "prompt_lookup": {"tokens_per_s": 15.0, "vs_greedy": 1.5, "equals_greedy": 2},
        "rows": [{"budget": 8, "drafter_cache": True, "head_layout": "auto", "tau": 3.0, "tokens_per_s": 18.0,
                  "vs_greedy": 1.8, "vs_prompt_lookup": 1.2, "equals_greedy": 2, "ms_per_round": 10.0,
                  "stage_ms_per_round": stage, "copy_tail": 0, "nodes_per_round": 8.0},
                 {"budget": 4, "drafter_cache": True, "head_layout": "auto", "tau": 3.5, "tokens_per_s": 19.0,
                  "vs_greedy": 1.9, "vs_prompt_lookup": 1.27, "equals_greedy": 2, "ms_per_round": 11.0,
                  "stage_ms_per_round": stage, "copy_tail": 8, "draft_vocab": 4096, "nodes_per_round": 6.5},
                 {"budget": 4, "drafter_cache": True, "head_layout": "auto", "tau": 3.6, "tokens_per_s": 19.0,
                  "vs_greedy": 1.9, "vs_prompt_lookup": 1.27, "equals_greedy": 2, "ms_per_round": 11.0,
                  "stage_ms_per_round": stage, "copy_tail": 8, "copy_earliest": True, "nodes_per_round": 7.5},
                 {"budget": 2, "drafter_cache": True, "head_layout": "auto", "tau": 4.5, "tokens_per_s": 21.0,
                  "vs_greedy": 2.1, "vs_prompt_lookup": 1.4, "equals_greedy": 2, "ms_per_round": 12.0,
                  "stage_ms_per_round": stage, "copy_tail": 10, "copy_lead": 4, "nodes_per_round": 12.0}],
    }
    dialogue = {
        "name": "dialogue", "prompts": 2,
        "greedy": {"tokens_per_s": 10.0},
        "prompt_lookup": {"tokens_per_s": 8.0, "vs_greedy": 0.8, "equals_greedy": 2},
        "rows": [{"budget": 0, "drafter_cache": True, "head_layout": "auto", "tau": 1.0, "tokens_per_s": 10.1,
                  "vs_greedy": 1.01, "vs_prompt_lookup": 1.26, "equals_greedy": 2, "ms_per_round": 100.0,
                  "stage_ms_per_round": stage, "copy_tail": 0, "nodes_per_round": 0.0, "auto": True}],
        "auto": {"reason": "decode auto -> greedy, no drafter: no setting beats greedy on this host"},
    }
    restating = {
        "name": "restating", "prompts": 2,
        "greedy": {"tokens_per_s": 10.0},
        "prompt_lookup": {"tokens_per_s": 16.6, "vs_greedy": 1.66, "equals_greedy": 2},
        "rows": [{"budget": 4, "drafter_cache": True, "head_layout": "auto", "tau": 4.0, "tokens_per_s": 15.7,
                  "vs_greedy": 1.57, "vs_prompt_lookup": 0.95, "equals_greedy": 2, "ms_per_round": 9.0,
                  "stage_ms_per_round": stage, "copy_tail": 10, "draft_vocab": 4096, "nodes_per_round": 9.5,
                  "miss_steps": 2, "auto": True,
                  "round_kinds": {"drafted": {"rounds": 10, "ms": 120.0, "block_length": 3.4},
                                  "step": {"rounds": 4, "ms": 61.5, "block_length": 1.0}}}],
        "auto": {"reason": "decode auto -> B=4, draft vocab 4096, copy tail 10 (round 9 ms, tau 4.00)"},
        "prompt_indices": [8, 10],  # auto's run: measured in turn with the probe's prompts
    }
    result = {
        "host": {"cpu_model": "Some CPU", "cpu_capability": "AVX2", "threads": 2, "torch": "2.13.0"},
        "skip": 8, "new_tokens": 16, "drafter": "d", "context_window": 512, "lookup_tokens": 10,
        "round_positions": 4, "sets": [code, restating, dialogue],
        "drafter_round": [{"context": 100, "full_ms": 20.0, "cached_ms": 5.0, "speedup": 4.0}],
        "head_layout": [{"rows": 7, "weight": [100, 8], "dtype": "float32", "threads": 2, "layout": "W @ x.T",
                         "linear_ms": 35.0, "transposed_ms": 9.0}],
    }
    md = bench_decode.to_markdown(result)
    assert "Some CPU (bf16/AMX flags: ?), capability AVX2, 2 threads" in md  # an older record: no flags
    assert "### code: 2 held-out prompts (#8-#9) x 16 tokens" in md  # an older result: no indices, a stretch
    assert "### restating: 2 held-out prompts (#8, #10) x 16 tokens" in md
    assert md.index("### code") < md.index("| HF prompt lookup (10) | - | - | 15.0 | 1.50x | 1.00x | 2/2 |")
    assert md.index("### restating") < md.index("| HF prompt lookup (10) | - | - | 16.6 | 1.66x | 1.00x | 2/2 |")
    ours = ("| ours B=8, drafter cache on, head auto | 3.00 | 8.0 | 18.0 | 1.80x | 1.20x | 2/2 | 10.0 | 0.0 | 1.0 "
            "| 2.0 | 3.0 | 4.0 |")
    assert ours in md
    tail = "| ours B=4, drafter cache on, head auto, copy tail 8, draft vocab 4096 | 3.50 | 6.5 | 19.0 | 1.90x |"
    assert tail in md
    assert "| ours B=4, drafter cache on, head auto, copy tail 8, both copy chains | 3.60 | 7.5 |" in md
    assert ("| ours auto: B=4, draft vocab 4096, copy tail 10, miss steps 2 | 4.00 | 9.5 | 15.7 | 1.57x | 0.95x | 2/2 |"
            in md)
    assert ("Rounds of ours auto: B=4, draft vocab 4096, copy tail 10, miss steps 2: drafted 10 at 120 ms, tau 3.40; "
            "step 4 at 62 ms, tau 1.00.") in md
    assert "Probe: decode auto -> B=4, draft vocab 4096, copy tail 10 (round 9 ms, tau 4.00)." in md
    assert "| ours B=2, drafter cache on, head auto, copy tail 10, copy lead 4 | 4.50 | 12.0 | 21.0 |" in md
    assert "| ours auto: greedy, no drafter | 1.00 | 0.0 | 10.1 | 1.01x | 1.26x | 2/2 |" in md
    assert "| 100 | 20.0 | 5.0 | 4.0x |" in md
    assert "| 7 | 100 x 8 | 35.0 | 9.0 | W @ x.T |" in md  # one line per row count and head (vocabulary)


def test_a_set_is_measured_with_every_output_checked_against_greedy(target, monkeypatch):
    """One set through the bench's own loop on the tiny target: greedy, prompt lookup, a fixed and an
    auto decoder (scripted timings: the probe's choice, not this host's speed, is under test)."""
    monkeypatch.setattr(target, "eos_token_ids", [])
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, copy_ngrams=[2, 1]).eval()
    prompts = [PROMPT, PROMPT[3:] + PROMPT]
    fixed = bench_decode._fixed_decoders(target, drafter, None, [4], [True], ["auto"], [0], [0], [0, 2])
    auto, _ = auto_decoder(target, drafter, prompts, max_budget=4, answer_tokens=8, copy_tails=(0, 10),
                           timer=lambda s: 1.0 if s is None else 1.0 + s.budget / 4)
    measured = bench_decode._measure_set(
        target, prompts, [*fixed, ({"budget": auto.budget, "drafter_cache": True, "head_layout": "auto",
                                    "copy_tail": auto.copy_tail, "draft_vocab": 0, "auto": True}, auto)],
        new_tokens=12, lookup_tokens=10, name="code")
    assert measured["name"] == "code" and measured["prompts"] == 2
    assert measured["prompt_lookup"]["equals_greedy"] == 2
    assert [r["auto"] for r in measured["rows"]] == [False, False, True]
    assert [r["copy_lead"] for r in measured["rows"][:2]] == [0, 2]
    assert all(r["equals_greedy"] == 2 and r["tau"] >= 1 and r["vs_greedy"] > 0 for r in measured["rows"])
    for r in measured["rows"]:  # the kinds split the rounds: their counts and blocks give the row's tau
        kinds = r["round_kinds"].values()
        assert set(r["round_kinds"]) <= {"drafted", "copy-led", "step"} and all(k["ms"] > 0 for k in kinds)
        rounds = sum(k["rounds"] for k in kinds)
        assert sum(k["rounds"] * k["block_length"] for k in kinds) / rounds == pytest.approx(r["tau"])


def test_the_fixed_grid_varies_the_copy_chains_only_with_a_copy_tail(target):
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0).eval()
    fixed = bench_decode._fixed_decoders(target, drafter, None, [2], [True], ["auto"], [0, 3], [0],
                                         copy_earliest=[False, True])
    assert [(m["copy_tail"], m["copy_earliest"]) for m, _ in fixed] == [(0, False), (3, False), (3, True)]
    assert [d.copy_earliest for _, d in fixed] == [False, False, True]


def test_the_fixed_grid_crosses_the_miss_steps_with_every_setting(target):
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0).eval()
    fixed = bench_decode._fixed_decoders(target, drafter, None, [2, 4], [True], ["auto"], [0], [0], miss_steps=[0, 3])
    assert [(m["budget"], m["miss_steps"], d.miss_steps) for m, d in fixed] == [(2, 0, 0), (2, 3, 3), (4, 0, 0),
                                                                               (4, 3, 3)]
    assert bench_decode._row_label(fixed[1][0]).endswith(", miss steps 3")
    assert bench_decode.host_line({"cpu_model": "X", "cpu_units": "amx_bf16", "cpu_capability": "AVX512",
                                   "threads": 2, "torch": "2"}) == ("X (bf16/AMX flags: amx_bf16), capability AVX512, "
                                                                    "2 threads, torch 2")


def test_the_probe_prompts_are_taken_in_turn_with_the_measured_ones():
    assert bench_decode.interleaved_split(list(range(10)), 4, 4) == ([0, 2, 4, 6], [1, 3, 5, 7])
    assert bench_decode.interleaved_split(list(range(10)), 5, 2) == ([0, 2, 4, 5, 6], [1, 3])
    assert bench_decode.interleaved_split(list(range(10)), 2, 5) == ([0, 2], [1, 3, 4, 5, 6])
    assert bench_decode.interleaved_split([7], 1, 0) == ([7], [])
    for first, second in ((1, 1), (2, 3)):
        a, b = bench_decode.interleaved_split(list(range(5)), first, second)
        assert len(a) == first and len(b) == second and not set(a) & set(b)
    with pytest.raises(ValueError, match="lower --skip"):
        bench_decode.interleaved_split([1, 2], 2, 1)


def test_the_restating_set_wraps_each_humaneval_prompt_in_the_request():
    code = 'def f(x: int) -> int:\n    """Twice x."""\n'
    request = bench_decode.restating_request(f"Complete the following Python function.\n\n```python\n{code}```")
    assert request == bench_decode.RESTATE_INSTRUCTION.format(prompt=code.strip("\n"))
    assert "Complete the following" not in request and request.count("```") == 2
    assert bench_decode.restating_request(code) == request  # a bare prompt: the whole text is the code
    assert set(bench_decode.SETS) == {"code", "dialogue", "math", "restating"}
    with pytest.raises(ValueError, match="--sets"):
        bench_decode.run(None, [4], 1, 0, 4, sets=["poetry"])
