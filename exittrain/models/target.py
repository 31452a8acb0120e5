"""The frozen target model: loading, tree scoring, cache compaction, drafter features.

docs/algorithm.md section 3. The target is a Hugging Face causal LM (Llama, Mistral, Phi-3, Qwen2,
Qwen3, Qwen3-MoE, Gemma 3, ...: docs/models.md lists what is tested and what is
refused) wrapped in :class:`TargetModel`, which never trains: its
parameters have ``requires_grad=False``, it stays in eval mode, and every method runs under
``torch.no_grad()``.

Shape legend: N trees or batch rows, T sequence length, C cached context length, B tree budget
(nodes, root excluded; a tree has B+1 rows with the root in row 0), V vocabulary, H target hidden
size, F = len(layers) * H feature width, L sequences and A anchors per sequence (training),
W prefix window, Q query tokens of one forward.

**Layer ids.** Layer id ``l`` in ``[0, num_layers)`` names the output of decoder layer ``l``: the
residual stream after that layer, before the final norm. It is Hugging Face's
``hidden_states[l + 1]`` for every layer except the last, where Hugging Face returns the
final-normed state and we do not. Features of several layers are concatenated along the last
dimension in the order given. They are captured with forward hooks on the decoder layers, so
only the requested layers are kept.

**Tree attention.** A tree is scored by one forward over ``[root, node_1..node_B]`` with explicit
position ids (root position + depth) and a 4D additive attention mask: each tree row sees the
context, its ancestors and itself. Hugging Face passes a 4D mask to the attention unchanged
(``masking_utils._preprocess_mask_arguments``), so this needs the ``eager`` or ``sdpa`` attention
implementation, and the model's own sliding window is not applied on top of it: for a
sliding-window layer (window w) the tree mask itself hides every key at ``query position - key
position >= w``, as the plain forward of the path does, and a model with both kinds of layers gets
a dict of masks by layer type (:func:`~exittrain.models.target_model.attention_windows`). On
``sdpa`` these forwards run :mod:`exittrain.models.grouped_attention`, so grouped query heads
read the cached keys in place on a CPU rather than copies per head.
:class:`TargetModel` refuses at load time what a tree mask cannot express (bidirectional or
chunked attention, other layer types, attention soft-capping under sdpa), and a tree forward past
the limit of a position-dependent rotary embedding (``dynamic``, ``longrope``:
:func:`~exittrain.models.target_model.position_limit`). Padding nodes of a
:class:`~exittrain.core.DraftTree` see only the root and themselves, so they change no other row.

**Caches.** Decoding uses a ``transformers.DynamicCache`` whose layers are ``DynamicLayer``
(keys and values of shape (batch, kv_heads, seq, head_dim), grown by concatenation).
:meth:`TargetModel.new_cache` builds one for sliding-window layers too (transformers would drop
the keys that leave the window), so those layers hold the whole context.
:meth:`TargetModel.commit` gathers the kept positions along the sequence dimension of each
layer, so the cache then equals the cache of the plain accepted sequence.

**Devices.** Everything a method returns lives on :attr:`TargetModel.device`, the input
embeddings' device, where input ids go and where the drafter must run (it applies the shared
embeddings; the training module checks the drafter's device at fit start). This matters with
``device_map`` over several GPUs: the captured layer outputs sit on their layers' GPUs and the LM
head may sit on the last one. ``Tensor.to`` returns the tensor itself when it is already there,
so a single-device target pays no copy.

**Limits.** Batch decoding with per-row acceptance (ragged caches) is not supported: ``commit``
takes one row. ``score_trees`` returns full-vocabulary logits, (N, B+1, V) in the model dtype;
``chunk_size`` bounds the activations of one forward, not these logits: for a large vocabulary
call it on fewer anchors.
"""


# The public face of the target: the wrapper lives in target_model.py, its decoding operations in
# target_decode.py, its training-time scoring in target_scoring.py and the loaders in
# target_loading.py; import them from here.

from exittrain.models.target_decode import PrefillOutput, TreeForwardOutput
from exittrain.models.target_loading import (
    EMBEDDED_TARGET_NAME,
    as_dtype,
    convert_embedded_target,
    load_target,
    resolve_device,
)
from exittrain.models.target_model import (
    SUPPORTED_ATTENTION,
    TargetModel,
    attention_windows,
    layer_output_hooks,
    position_limit,
)
from exittrain.models.target_scoring import SequencePrefix, TreeScores

__all__ = [
    "EMBEDDED_TARGET_NAME",
    "SUPPORTED_ATTENTION",
    "PrefillOutput",
    "SequencePrefix",
    "TargetModel",
    "TreeForwardOutput",
    "TreeScores",
    "as_dtype",
    "attention_windows",
    "convert_embedded_target",
    "layer_output_hooks",
    "load_target",
    "position_limit",
    "resolve_device",
]
