"""The frozen target model: loading, tree scoring, cache compaction, drafter features.

docs/algorithm.md section 3. The target is a Hugging Face causal LM (Llama, Qwen2, Qwen3, ... with
full attention in every layer) wrapped in :class:`TargetModel`, which never trains: its
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
implementation and a model without sliding-window layers; :class:`TargetModel` checks both.
Padding nodes of a :class:`~exittrain.core.DraftTree` see only the root and themselves, so they
change no other row.

**Caches.** Decoding uses a ``transformers.DynamicCache`` whose layers are ``DynamicLayer``
(keys and values of shape (batch, kv_heads, seq, head_dim), grown by concatenation). This is
what transformers 5.24 builds for Llama, Qwen2 and Qwen3 without sliding windows.
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
from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, as_dtype, convert_embedded_target, load_target
from exittrain.models.target_model import SUPPORTED_ATTENTION, TargetModel, layer_output_hooks
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
    "convert_embedded_target",
    "layer_output_hooks",
    "load_target",
]
