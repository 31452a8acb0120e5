"""The block drafter's configuration (:class:`DrafterConfig`) and its pairing with a target.

The drafter's function and parameter names are those of a DFlash draft model (see
:mod:`exittrain.models.drafter.block_drafter`); the fields below name what it reads from the target, the Qwen3
layer shape, and exittrain's own extensions. :meth:`DrafterConfig.dflash_problems` lists the
extensions a DFlash checkpoint cannot hold, so the export (:mod:`exittrain.models.dflash_format`)
can refuse or drop them by name.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from exittrain.core.ngram_copy import check_ngrams

__all__ = ["DrafterConfig", "check_pairing"]


class DrafterConfig(PreTrainedConfig):
    """Configuration of a :class:`~exittrain.models.drafter.block_drafter.BlockDrafter`; records its target.

    Target: ``target_*`` (empty/0 only in the default instance Hugging Face builds internally),
    ``target_layer_ids`` in our convention (:mod:`exittrain.models.target_model`: id l = output of
    decoder layer l). ``block_size`` S >= 2 (K = S - 1 predicted tokens).

    Layer shape (Qwen3 style): ``hidden_size`` D, ``num_heads`` query heads, ``num_key_value_heads``
    (default ``num_heads``; must divide it), ``head_dim`` (default D / num_heads, even for the
    rotary embedding), ``intermediate_size`` (default 3 * D), ``rms_norm_eps``, ``rope_theta``
    (default rotary embedding only), ``max_position_embeddings`` (recorded for serving engines).

    Extensions (each off in a DFlash checkpoint, :meth:`dflash_problems`):
    ``learned_mask`` (True: the mask rows are a trained vector, initialised from the target
    embedding of ``mask_token_id`` or zero; False: they are the frozen target embedding of
    ``mask_token_id``, as in DFlash), ``context_window`` W (None = the whole prefix),
    ``copy_ngrams`` / ``copy_gate_init`` (the n-gram copy branch), and D != target hidden size
    (input/output projections).
    """

    model_type = "exittrain_block_drafter"
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}

    target_name: str = ""
    target_vocab_size: int = 0
    target_hidden_size: int = 0
    target_num_layers: int = 0
    target_layer_ids: list[int] | None = None
    block_size: int = 8
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    learned_mask: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    context_window: int | None = None
    copy_ngrams: list[int] | None = None
    copy_gate_init: float = 0.7
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_heads
        if self.head_dim is None and self.num_heads and self.hidden_size % self.num_heads == 0:
            self.head_dim = self.hidden_size // self.num_heads
        self.target_layer_ids = [int(x) for x in (self.target_layer_ids or [])]
        self.copy_ngrams = list(self.copy_ngrams or [])
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(
            isinstance(self.block_size, int) and self.block_size >= 2,
            f"block_size={self.block_size!r}: need an int >= 2 (root + at least one predicted token); "
            "set block_size to K + 1 for K draft tokens",
        )
        need(self.num_layers >= 1, f"num_layers={self.num_layers}: need at least 1 drafter layer")
        need(
            self.num_heads >= 1 and isinstance(self.head_dim, int) and self.head_dim >= 2 and self.head_dim % 2 == 0,
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}: need an even "
            "head_dim (rotary); set head_dim, or a num_heads that divides hidden_size into even heads",
        )
        need(
            self.num_key_value_heads >= 1 and self.num_heads % self.num_key_value_heads == 0,
            f"num_key_value_heads={self.num_key_value_heads}: must divide num_heads={self.num_heads} "
            "(grouped-query attention)",
        )
        need(
            self.context_window is None or self.context_window >= 1,
            f"context_window={self.context_window!r}: need None (whole prefix) or a positive int",
        )
        check_ngrams(self.copy_ngrams, "copy_ngrams")
        need(
            0.0 < self.copy_gate_init < 1.0,
            f"copy_gate_init={self.copy_gate_init!r}: need the copy gate's starting value in (0, 1), e.g. 0.7",
        )
        need(
            self.learned_mask or self.mask_token_id is not None,
            "learned_mask=False needs mask_token_id: the mask rows are then the target embedding of that token",
        )
        if self.target_num_layers:
            bad = [x for x in self.target_layer_ids if not 0 <= x < self.target_num_layers]
            need(
                bool(self.target_layer_ids) and not bad,
                f"target_layer_ids={self.target_layer_ids}: need a non-empty list of layer ids in "
                f"[0, {self.target_num_layers}) of target {self.target_name!r}",
            )
        if self.mask_token_id is not None and self.target_vocab_size:
            need(
                0 <= self.mask_token_id < self.target_vocab_size,
                f"mask_token_id={self.mask_token_id}: need a token id in [0, {self.target_vocab_size}) or None",
            )

    @property
    def num_draft_tokens(self) -> int:
        """K = block_size - 1."""
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        """F = len(target_layer_ids) * target_hidden_size."""
        return len(self.target_layer_ids) * self.target_hidden_size

    def dflash_problems(self) -> dict[str, str]:
        """The extensions a DFlash checkpoint cannot hold: ``{field: why}`` (empty = none).

        ``copy_ngrams`` and ``learned_mask`` are listed too; the export drops the first (saying so)
        and ships the second as vLLM's separate mask embedding file."""
        out: dict[str, str] = {}
        if self.hidden_size != self.target_hidden_size:
            out["hidden_size"] = (
                f"the drafter is {self.hidden_size} wide with projections to the target's {self.target_hidden_size}; "
                "a DFlash drafter is as wide as its target (train with drafter.hidden_size=null)"
            )
        if self.context_window is not None:
            out["context_window"] = (
                f"the drafter attends to the last {self.context_window} positions only; a DFlash drafter attends "
                "to the whole context (train with drafter.context_window=null)"
            )
        if self.target_num_layers - 1 in self.target_layer_ids:
            out["target_layer_ids"] = (
                f"layer {self.target_num_layers - 1} is the target's last: runtimes disagree on whether its "
                "feature is final-normed (choose layer ids below the last)"
            )
        if self.copy_ngrams:
            out["copy_ngrams"] = f"the n-gram copy branch (copy_ngrams={self.copy_ngrams}) has no place in the format"
        if self.learned_mask:
            out["learned_mask"] = "the mask rows are a learned vector, not the target embedding of mask_token_id"
        return out


def check_pairing(config: DrafterConfig, target, *, check_name: bool = True) -> None:
    """Raise ValueError if a drafter with ``config`` does not belong to ``target``.

    Compares vocabulary size, hidden size, number of layers, the layer ids' range and (unless
    ``check_name=False``) the target name.
    """
    mine, theirs = f"target {config.target_name!r}", f"target {target.name!r}"
    fix = "load the target it was trained for, or train a new drafter with new_drafter(target)"
    checks = [
        ("target_vocab_size", config.target_vocab_size, target.vocab_size),
        ("target_hidden_size", config.target_hidden_size, target.hidden_size),
        ("target_num_layers", config.target_num_layers, target.num_layers),
    ]
    for field, want, got in checks:
        if want != got:
            raise ValueError(f"drafter was saved for {mine} with {field}={want}, but {theirs} has {got}; {fix}")
    bad = [x for x in config.target_layer_ids if not 0 <= x < target.num_layers]
    if bad or not config.target_layer_ids:
        raise ValueError(
            f"drafter target_layer_ids={config.target_layer_ids} (saved for {mine}) are out of range for "
            f"{theirs} with {target.num_layers} layers; {fix}"
        )
    if check_name and config.target_name != target.name:
        raise ValueError(
            f"drafter was saved for {mine} (target_name), but it is being paired with {theirs}; {fix} "
            "(if both are the same model under different names, pass check_name=False)"
        )
