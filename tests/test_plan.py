"""`python -m exittrain plan`: the plan's byte counts, by hand, on a tiny target's config.

The target is a tiny Llama config saved to a folder (no weights: the plan reads config.json and
builds the target and the drafter on the meta device). Every expected figure is written out from
the shapes, so a change in what the plan counts shows up here as a number.
"""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from exittrain.plan import KNOWN_CONFIGS, make_plan, parse_size

# the tiny target: V vocabulary, H width, I MLP width, layers, heads, KV heads, head size
V, H, I, LAYERS, HEADS, KV, HD = 512, 64, 128, 4, 4, 2, 16  # noqa: E741
# the run: L rows of T tokens, A anchors per row, trees of budget B, block S (K = S - 1 drafted tokens)
L, T, A, B, S, PROMPTS, NEW = 4, 64, 4, 3, 8, 10, 8
K = S - 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_config")
    LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=HD, tie_word_embeddings=False, max_position_embeddings=2048,
    ).save_pretrained(folder)  # config.json only: no weights
    return folder


def overrides(tiny_dir, tmp_path, *extra: str) -> list[str]:
    return [
        "+recipe=code", "target=hub", f"target.name_or_path={tiny_dir}", "target.dtype=float32", "target.device=cpu",
        "trainer.precision=32-true", f"paths.output_dir={tmp_path}", f"data.batch_size={L}", f"data.max_length={T}",
        f"data.max_train_prompts={PROMPTS}", "data.generation.batch_size=1", f"data.generation.max_new_tokens={NEW}",
        "data.generation.dtype=null",  # auto would measure this host's bf16 speed
        f"objective.anchors_per_seq={A}", f"stages.exittrain.anchors_per_seq={A}", f"tree.budget_train={B}",
        *extra,
    ]  # fmt: skip


def items(plan, stage: str, kind: str, phase: str) -> dict[str, int]:
    step = next(s for s in plan.steps if s.stage == stage and s.kind == kind)
    return {i.name: i.bytes for i in step.phases[phase]}


# the tiny Llama's parameters: embeddings, per layer Q/K/V/O + MLP + 2 norms, final norm, untied head
TARGET_PARAMS = V * H + LAYERS * (H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H + 3 * H * I + 2 * H) + H + V * H
# the default drafter (conf/drafter/block.yaml) on it: 2 layers shaped like the target's (a copy of
# its last layer), feature layers default_layer_ids(4) = [2] (F = H), a learned mask row, the copy gate
# (2 n-gram lengths, with bias: the hand count takes drafter=copy_branch, the larger path); per layer also the
# per-head Q/K norms
LAYER = H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H + 2 * HD + 2 * H + 3 * H * I
DRAFTER_PARAMS = H * H + H + H + 2 * LAYER + H + (H * 2 + 2)


def test_bytes_match_the_hand_count(tiny_dir, tmp_path):
    plan = make_plan([*overrides(tiny_dir, tmp_path), "drafter=copy_branch"])
    assert plan.target["params"] == TARGET_PARAMS and plan.drafter["params"] == DRAFTER_PARAMS
    rotary = 2 * (HD // 2) * 4  # the rotary embedding's buffers inv_freq and original_inv_freq, fp32
    assert plan.target["bytes"] == TARGET_PARAMS * 4 + rotary
    N, e = L * A, L * A * K * V
    train = items(plan, "exittrain", "train", "tree scoring")
    assert train["target weights (frozen)"] == plan.target["bytes"]
    assert train["drafter parameters"] == DRAFTER_PARAMS * 4  # fp32 under 32-true
    assert train["drafter gradients"] == DRAFTER_PARAMS * 4
    assert train["AdamW moments (exp_avg, exp_avg_sq)"] == DRAFTER_PARAMS * 2 * 4
    assert train["prefix K/V (causal pass)"] == LAYERS * 2 * L * T * KV * HD * 4
    Q = A * (B + 1)  # tree rows of one forward per row, unchunked
    assert train["prefix + chunk K/V (one forward's cache)"] == LAYERS * 2 * L * (T + Q) * KV * HD * 4
    assert train["tree logits, returned"] == N * (B + 1) * V * 4
    assert "one chunk's logits" not in train  # unchunked, the forward's logits are the result
    assert train["drafter log-probs (log_softmax, copy mix)"] == e * 8  # kept for backward: log_softmax + mixture
    assert train["block CE log-probs (kept for backward)"] == e * 4
    assert train["target features fp32"] == L * T * H * 4  # F = one feature layer x H
    probs = items(plan, "exittrain", "train", "target probabilities")
    assert probs["target probabilities fp32"] == N * (B + 1) * V * 4
    node = items(plan, "exittrain", "train", "node loss")
    assert node["node loss log-probs and labels (kept), copy and product"] == e * 16
    assert plan.peak == max(step.peak for step in plan.steps) > plan.target["bytes"]
    assert plan.world == {"devices": 1, "nodes": 1, "world_size": 1, "strategy": "single"}
    held = max(1, round(0.03 * PROMPTS))  # data.val_fraction's rows, whole tasks
    assert plan.schedule["steps per epoch per rank (<=)"] == -(-(PROMPTS - held) // L)
    assert plan.schedule["exittrain: tree rows scored per training step per rank"] == L * A * (B + 1)


@pytest.mark.parametrize("chunk", [1, 2])
def test_chunking_lowers_the_forward_logits_by_the_chunk_factor(tiny_dir, tmp_path, chunk):
    plan = make_plan(overrides(tiny_dir, tmp_path, f"tree.score_chunk_size={chunk}"))
    scoring = items(plan, "exittrain", "train", "tree scoring")
    assert scoring["one chunk's logits"] == L * chunk * (B + 1) * V * 4
    assert scoring["one chunk's logits"] * (A // chunk) == scoring["tree logits, returned"]  # what all-at-once holds
    Q = chunk * (B + 1)
    assert scoring["prefix + chunk K/V (one forward's cache)"] == LAYERS * 2 * L * (T + Q) * KV * HD * 4


def test_feature_cache_false_removes_the_features_from_host_memory(tiny_dir, tmp_path):
    on = make_plan(overrides(tiny_dir, tmp_path, "objective.feature_cache=true"))
    off = make_plan(overrides(tiny_dir, tmp_path, "objective.feature_cache=false"))
    rows = PROMPTS * min(T, 512 + NEW)  # every row cut at max_length (prompts up to max_prompt_tokens=512)
    labels = PROMPTS * NEW * 16 * 8  # top-16 ids int32 + log-probs fp32 per answer token
    data_on, data_off = ({i.name: i.bytes for i in p.data} for p in (on, off))
    assert data_on["target features (bf16)"] == rows * H * 2
    assert data_on["host memory per process (feature store)"] == rows * H * 2 + labels
    assert data_off["target features (bf16)"] == 0 and data_off["host memory per process (feature store)"] == 0
    train_on = items(on, "exittrain", "train", "tree scoring")
    train_off = items(off, "exittrain", "train", "tree scoring")
    assert train_on["feature store (host memory of the process)"] == rows * H * 2 + labels  # a CPU run: same memory
    assert train_off["feature store (host memory of the process)"] == 0
    assert train_on["batch features (feature store, bf16)"] == L * T * H * 2
    assert "batch features (feature store, bf16)" not in train_off
    off_step = next(s for s in off.steps if s.stage == "exittrain" and s.kind == "train")
    assert "target features" in off_step.phases  # the target computes them every step instead


def test_corpus_rows_add_their_storage_and_one_prefill_per_batch(tiny_dir, tmp_path):
    """data.corpus_sources: the corpus rows' tokens, soft labels and features (every row max_length long), their
    labelling pass's memory, and its forwards and FLOPs beside the answering's; none of it without them."""
    rows, top = 20, 16
    plain = make_plan(overrides(tiny_dir, tmp_path))
    corpus = ["data.corpus_sources=[corpus:codeio]", f"data.max_corpus_rows={rows}"]
    plan = make_plan(overrides(tiny_dir, tmp_path, *corpus))
    data, before = {i.name: i.bytes for i in plan.data}, {i.name: i.bytes for i in plain.data}
    answers, tokens = PROMPTS * NEW, PROMPTS * min(T, 512 + NEW)
    assert data["corpus row tokens (<=)"] == rows * T and "corpus row tokens (<=)" not in before
    assert data["soft labels (top-k ids int32 + log-probs fp32)"] == (answers + rows * (T - 1)) * top * 8
    assert before["soft labels (top-k ids int32 + log-probs fp32)"] == answers * top * 8
    assert data["target features (bf16)"] == (tokens + rows * T) * H * 2
    host = data["soft labels (top-k ids int32 + log-probs fp32)"] + data["target features (bf16)"]
    assert plan.data[-1].bytes == host  # the feature store holds both entries
    label = next(st for st in plan.steps if st.kind.startswith("corpus labelling"))
    assert not any(st.kind.startswith("corpus labelling") for st in plain.steps)
    held = {i.name: i.bytes for i in label.phases["labelling"]}
    assert held["kept logits, their fp32 copy and log-softmax"] == 8 * T * V * (4 + 8)  # 8 rows a forward, fp32
    assert held["captured feature layers (bf16)"] == 8 * T * H * 2
    sch = plan.schedule
    forwards = sch["data step: corpus labelling, target forwards (<=)"]
    assert forwards.startswith(f"ceil(max_corpus_rows/8) = {-(-rows // 8)},")
    assert sch["data step: corpus labelling, FLOPs (<=)"].endswith(f"= {2 * TARGET_PARAMS * rows * T:.3g}")
    assert sch["data step: answering, target forwards in sequence (<=)"].endswith(f"= {PROMPTS * (1 + NEW)}")
    assert not any("corpus" in key for key in plain.schedule)
    every = make_plan(overrides(tiny_dir, tmp_path, "data.corpus_sources=[corpus:codeio]"))
    assert {i.name: i.bytes for i in every.data}["corpus rows"] == 0  # every row: not counted, and said so


def test_a_small_device_does_not_fit_and_gets_ranked_changes(tiny_dir, tmp_path):
    plan = make_plan(overrides(tiny_dir, tmp_path), device_memory="1MiB")
    assert plan.verdict == "does not fit" and (plan.peak_step.stage, plan.peak_step.kind) == ("exittrain", "train")
    assert plan.suggestions and all(s["saves"] > 0 for s in plan.suggestions)
    singles = [s for s in plan.suggestions if not s["change"].startswith("all of")]
    assert [s["saves"] for s in singles] == sorted((s["saves"] for s in singles), reverse=True)
    assert any(s["change"].startswith("data.batch_size=") for s in singles)
    text = plan.to_markdown()
    assert "**does not fit**" in text and "What to change" in text and "Not seen by this plan" in text
    roomy = make_plan(overrides(tiny_dir, tmp_path), device_memory="1TiB")
    assert roomy.verdict == "fits" and roomy.suggestions == []


def test_known_configs_plan_an_8b_target_without_its_files(tmp_path):
    """Qwen3-8B from the published values (no hub cache here), with its DFlash drafter's shape."""
    plan = make_plan([
        "+recipe=code", "target=qwen3_8b", f"target.cache_dir={tmp_path}", "trainer=ddp", "trainer.devices=8",
        "warm_start=z-lab/Qwen3-8B-DFlash-b16", f"paths.output_dir={tmp_path}",
    ], device_memory="80GiB")  # fmt: skip
    c = KNOWN_CONFIGS["Qwen/Qwen3-8B"]
    h, n, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    kv, i = c["num_key_value_heads"], c["intermediate_size"]
    layer = h * n * hd + 2 * h * kv * hd + n * hd * h + 2 * hd + 2 * h + 3 * h * i  # Qwen3: per-head Q/K norms
    assert plan.target["params"] == 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h
    assert plan.target["params"] == 8_190_735_360 and plan.target["dtype"] == "torch.bfloat16"
    assert plan.drafter["params"] == 5 * h * h + h + 5 * layer + h  # fc over 5 feature layers, 5 layers, norm
    assert plan.drafter["block_size"] == 16 and plan.drafter["layer_ids"] == [1, 9, 17, 25, 33]
    assert "KNOWN_CONFIGS" in plan.target["source"] and any("KNOWN_DFLASH" in n for n in plan.notes)
    assert plan.world["world_size"] == 8 and plan.world["strategy"] == "ddp"
    assert plan.verdict in ("fits", "tight", "does not fit")


@pytest.mark.parametrize("text, size", [("80GiB", 80 * 2**30), ("24 GiB", 24 * 2**30), ("80GB", 80 * 10**9),
                                        ("512MiB", 512 * 2**20), ("1.5TiB", int(1.5 * 2**40))])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80", "eighty GiB", "80 GiBs", "0GiB", ""])
def test_a_bad_size_names_the_option(text):
    with pytest.raises(ValueError, match="--device-memory="):
        parse_size(text)


def test_bad_input_names_the_key(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--device-memory='80'"):
        make_plan(overrides(tiny_dir, tmp_path), device_memory="80")
    with pytest.raises(ValueError, match=r"target\.name_or_path=.*does not exist"):
        make_plan(overrides(tmp_path / "no_such_folder", tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"target\.name_or_path=.*has no config\.json"):
        make_plan(overrides(tmp_path / "empty", tmp_path))
    with pytest.raises(ValueError, match=r"name_or_path=org/not-cached: its config\.json is not in the hub cache"):
        make_plan(overrides("org/not-cached", tmp_path, f"target.cache_dir={tmp_path}"))
    with pytest.raises(ValueError, match=r"trainer\.devices=-1: .*pass trainer\.devices=N"):
        make_plan(overrides(tiny_dir, tmp_path, "trainer=ddp", "trainer.precision=32-true"))
    with pytest.raises(ValueError, match=r"trainer\.precision='banana'"):
        make_plan(overrides(tiny_dir, tmp_path, "trainer.precision=banana"))
    with pytest.raises(ValueError, match="do not compose"):
        make_plan(overrides(tiny_dir, tmp_path, "tree.no_such_key=1"))
    with pytest.raises(ValueError, match=r"warm_start=.*no config\.json"):
        make_plan(overrides(tiny_dir, tmp_path, f"warm_start={tmp_path / 'empty'}"))


def test_the_command_prints_the_table_and_writes_json(tiny_dir, tmp_path, capsys):
    from exittrain.__main__ import main

    out = tmp_path / "plan.json"
    main(["plan", *overrides(tiny_dir, tmp_path), "--device-memory", "1TiB", "--json", str(out)])
    text = capsys.readouterr().out
    assert "Device memory at the peak" in text and "| item | formula | bytes |" in text and "**fits**" in text
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "fits" and saved["target"]["params"] == TARGET_PARAMS
    assert saved["peak_bytes"] == max(step["peak_bytes"] for step in saved["steps"])
    with pytest.raises(SystemExit) as stop:
        main(["plan", *overrides(tiny_dir, tmp_path), "--device-memory", "80"])
    assert stop.value.code == 2 and "--device-memory='80'" in capsys.readouterr().err
