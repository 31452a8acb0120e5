"""The Lightning DataModule of drafter training: prompts -> the target's own answers -> batches.

Which prompts, and which cache entry holds their answers, is :attr:`ExitTrainDataModule.plan`
(:class:`~exittrain.data.prompts.prompt_plan.PromptPlan`, Lightning-free). The hooks (Lightning calls them):

- ``prepare_data`` (called by every rank through :func:`exittrain.build.prepare_data`): answers this
  process's shard of the prompts into the Arrow cache (the last shard merges the entry)
  (:meth:`PromptPlan.regenerate`); the ``target`` callable builds the target only for a missing entry.
- ``setup`` (every process): opens the entry, drops rows whose prompt alone fills ``max_length`` and
  holds out ``val_fraction`` of the rows for a validation loss, whole tasks at a time
  (:func:`~exittrain.data.split.split_entry`), counted in :attr:`ExitTrainDataModule.stats`; with
  ``corpus_sources``, adds the corpus rows to the training rows (:mod:`exittrain.data.corpus`: their own
  entry, labelled by one target pass in ``prepare_data``; ``stats["rows"]`` counts each kind); opens
  the :attr:`~ExitTrainDataModule.store` of what the regeneration kept beside the answers (target
  features, top-k log-probabilities: :func:`~exittrain.data.feature_store.open_entry_store`).
- ``train_dataloader`` / ``val_dataloader``: right-padded batches from :class:`~exittrain.data.collate.Collator`
  (input_ids (L, T) long, loss_mask (L, T) bool, attention_mask (L, T) long, n_prompt_tokens (L,),
  lengths (L,), row_id (L,) = the row's ``prompt_index``: stable across epochs, unique across both
  splits; the store's rows too). Epoch e's training order is a function of ``seed`` and e only, and a
  resumed fit continues it where the checkpoint left off (``state_dict`` / ``load_state_dict``,
  :class:`~exittrain.data.sampler.ResumableSampler`).
- :meth:`ExitTrainDataModule.eval_prompts`: the held-out evaluation prompts, chat-templated, for
  decoding benchmarks; they never overlap the training prompts (:func:`exittrain.data.prompts.prompt_sets.load_domain`).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from exittrain.data.cache_integrity import verify_entry
from exittrain.data.collate import Collator
from exittrain.data.corpus import CorpusPlan, JoinedStore, check_corpus_settings, shift_row_ids
from exittrain.data.feature_store import FeatureStore, check_store_settings, open_entry_store
from exittrain.data.generation import GenerationConfig
from exittrain.data.prompts.prompt_plan import PromptPlan, SourceSpecs
from exittrain.data.prompts.prompt_sets import DEFAULT_MAX_CHARS, DomainPrompts
from exittrain.data.regenerate import TargetProvider
from exittrain.data.sampler import ResumableSampler, resume_point
from exittrain.data.split import check_loader_settings, corpus_train_rows, split_entry, split_rows
from exittrain.data.target_provider import LazyTarget

logger = logging.getLogger(__name__)


class ExitTrainDataModule(pl.LightningDataModule):
    """Self-distilled training data of one domain.

    Args:
        domain, train_sources, eval_sources, target_name, cache_dir, generation, max_train_prompts, seed,
            exclude_seed, exclude_size, max_prompt_chars, device: which prompts, and which cache entry holds their
            answers: :class:`~exittrain.data.prompts.prompt_plan.PromptPlan`'s arguments (documented there), held
            in :attr:`plan`. ``seed`` also seeds the validation split and the shuffling.
        target: callable returning ``(model, tokenizer)``, called only when regeneration is needed
            (or for :meth:`eval_prompts` without ``tokenizer``). Default: ``load_target(target_name)``.
        tokenizer: the target's tokenizer, or a callable returning it; lets :meth:`eval_prompts`
            work without building the model (:class:`~exittrain.data.target_provider.LazyTarget`).
        max_length: training sequences (prompt + response) are truncated to this many tokens.
        batch_size, num_workers: DataLoader settings.
        val_fraction: fraction of the regenerated training rows held out for validation loss
            (0 disables validation; otherwise at least one row), whole tasks at a time: both
            prompt forms of one CodeI/O task land on the same side
            (:func:`~exittrain.data.prompts.selection.split_by_task`).
        progress: show the regeneration progress bar.
        feature_layers: target layer ids whose outputs regeneration keeps beside the answers
            (:func:`~exittrain.data.regenerate.regenerate`); the :attr:`store` serves them in every
            batch, and training then never runs the target over a row. Not part of the cache key:
            an entry already cached without them is used as it is (training computes them).
        top_logprobs: S > 0 keeps the answering model's top-S next-token log-probabilities at every
            response position during regeneration; the :attr:`store` serves them in every batch as
            the soft labels of the block cross-entropy. Not part of the cache key either.
        feature_store: ``"memory"`` reads every row's features and soft labels into host memory at
            setup (each process holds all of them); ``"disk"`` reads each batch's rows from the cache
            entry's files (:mod:`exittrain.data.feature_store`), for data sets larger than host memory.
        corpus_sources: answered sources (``corpus:NAME``, ``chat-json:``, ``chat-hf:``) whose rows train
            beside the target's answers, labelled by one teacher-forced target pass into an entry of their
            own (:class:`~exittrain.data.corpus.CorpusPlan`: without the evaluation prompts and the held-out
            tasks); None or empty: the answers alone.
        max_corpus_rows: a seeded sample of at most this many corpus rows (None: all of them).
        vocab_size: the target's vocabulary (rows of its embedding): ``setup`` refuses an entry holding a
            token id outside it (:func:`~exittrain.data.cache_integrity.verify_entry`, which also checks
            the entry's checksums); None checks the checksums alone.
    """

    def __init__(
        self,
        domain: str | None = "code",
        *,
        train_sources: SourceSpecs | None = None,
        eval_sources: SourceSpecs | None = None,
        target_name: str | None = None,
        target: TargetProvider | None = None,
        tokenizer: Any = None,
        cache_dir: str | os.PathLike = "data/cache/regen",
        max_length: int = 640,
        batch_size: int = 8,
        num_workers: int = 0,
        generation: GenerationConfig | Mapping[str, Any] | None = None,
        max_train_prompts: int | None = None,
        val_fraction: float = 0.03,
        seed: int = 0,
        exclude_seed: int | None = None,
        exclude_size: int | None = None,
        max_prompt_chars: int | None = DEFAULT_MAX_CHARS,
        progress: bool = True,
        feature_layers: Sequence[int] | None = None,
        top_logprobs: int = 0,
        feature_store: str = "memory",
        device: str | None = None,
        corpus_sources: SourceSpecs | None = None,
        max_corpus_rows: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        check_loader_settings(max_length, batch_size, val_fraction)
        self.plan = PromptPlan(
            domain, train_sources=train_sources, eval_sources=eval_sources, target_name=target_name,
            cache_dir=cache_dir, generation=generation, max_train_prompts=max_train_prompts, seed=seed,
            exclude_seed=exclude_seed, exclude_size=exclude_size, max_prompt_chars=max_prompt_chars, device=device,
        )
        check_store_settings(top_logprobs, feature_store)
        check_corpus_settings(corpus_sources, max_corpus_rows)
        # the rows trained beside the answers, from an entry of their own (None: the answers alone)
        self.corpus = CorpusPlan(self.plan, corpus_sources, max_corpus_rows, max_length) if corpus_sources else None
        # the plan's settings the hooks read, under their argument names
        self.domain, self.target_name, self.cache_dir = self.plan.domain, self.plan.target_name, self.plan.cache_dir
        self.device, self.generation = self.plan.device, self.plan.generation
        self._target = LazyTarget(target_name, target, tokenizer)
        self.vocab_size = vocab_size
        self.max_length, self.batch_size, self.num_workers = max_length, batch_size, num_workers
        self.val_fraction, self.seed, self.progress = val_fraction, seed, progress
        # the training order's seed, when a replicate run shuffles the same rows in its own order (bench
        # exittrain's training seeds); None: ``seed``, which also chose the rows and the split
        self.order_seed: int | None = None
        self.feature_layers = list(feature_layers) if feature_layers is not None else None
        self.top_logprobs, self.feature_store = top_logprobs, feature_store
        # after setup, when feature_layers or top_logprobs ask for one (both entries' with corpus rows)
        self.store: FeatureStore | JoinedStore | None = None
        self._answers_train: datasets.Dataset | None = None  # the answers' training rows, before corpus rows join
        self._corpus_train: datasets.Dataset | None = None  # the corpus rows that train, row ids shifted

        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None
        self.pad_token_id: int | None = None
        self.stats: dict[str, Any] = {}
        self._resume_order: tuple[int, int] | None = None  # (epoch, batches done) from a checkpoint

    # -- prompts and their cache entry: self.plan --------------------------------------------------

    def prompts(self) -> DomainPrompts:
        """Train and eval prompts after cleaning, overlap removal, ``exclude_seed`` and ``max_train_prompts``."""
        return self.plan.prompts()

    @property
    def cache_path(self) -> Path:
        """Folder of this configuration's regenerated dataset (exists after ``prepare_data``)."""
        return self.plan.cache_path

    # -- Lightning hooks -------------------------------------------------------------------------

    @property
    def corpus_cache_path(self) -> Path | None:
        """Folder of the corpus rows' entry (None without ``corpus_sources``)."""
        return self.corpus.cache_path if self.corpus is not None else None

    def prepare_data(self) -> None:
        """Regenerate the target's answers unless they are cached, and label the corpus rows unless their entry
        is cached; loads the target only then."""
        kept = {"progress": self.progress, "feature_layers": self.feature_layers, "top_logprobs": self.top_logprobs}
        self.plan.regenerate(self._target.provide, **kept)
        if self.corpus is not None:
            self.corpus.write(self._target.provide, **kept)

    def setup(self, stage: str | None = None) -> None:
        """Open the cached dataset, split off the validation rows and open the store (every process);
        after :meth:`release_store`, open the store again."""
        self._split()
        if self.store is None and (self.feature_layers or self.top_logprobs):
            columns = ("prompt_index", "input_ids", "n_prompt_tokens")
            self.store = self._open_store(self.cache_path, split_rows(self._answers_train, self.val_set, *columns))
            if self._corpus_train is not None:
                shift = self.stats["rows"]["row_id_shift"]
                rows = ((r - shift, ids, p) for r, ids, p in split_rows(self._corpus_train, None, *columns))
                self.store = JoinedStore(self.store, self._open_store(self.corpus_cache_path, rows), shift)
            self.stats["feature_store"] = self.store.summary()

    def _open_store(self, path: Path, rows) -> FeatureStore:
        store = open_entry_store(path, rows, max_length=self.max_length, feature_layers=self.feature_layers,
                                 top_k=self.top_logprobs, mode=self.feature_store)
        assert store is not None  # feature_layers or top_logprobs asked for one
        return store

    def _split(self) -> None:
        """The training and validation rows of the cache entry (once)."""
        if self.train_set is not None:
            return
        path = self.cache_path
        if not path.is_dir():
            raise ValueError(
                f"no regenerated data at {path}; call prepare_data() first (Trainer.fit does), with the same "
                "sources, target_name, generation settings, max_train_prompts and seed"
            )
        dp = self.prompts()
        verify_entry(path, vocab_size=self.vocab_size)  # checksums and token range, before any row is read
        split = split_entry(path, dp, max_length=self.max_length, val_fraction=self.val_fraction, seed=self.seed)
        self.train_set, self.val_set, self.pad_token_id = split.train_set, split.val_set, split.pad_token_id
        self._answers_train = split.train_set
        self.stats = split.stats
        n_train, n_val = self.stats["train_rows"], self.stats["val_rows"]
        self.stats["rows"] = {"answers": n_train, "corpus": 0}
        if self.corpus is not None:
            self._join_corpus(dp)
        logger.info("data: %d train rows (%d answers of the target, %d corpus rows), %d val rows, %d eval prompts (%s)",
                    len(self.train_set), n_train, self.stats["rows"]["corpus"], n_val, len(dp.eval), path)

    def _join_corpus(self, dp: DomainPrompts) -> None:
        """Add the corpus rows that train (without the validation tasks) to :attr:`train_set`, row ids shifted
        past the answers' (:mod:`exittrain.data.corpus`)."""
        assert self.corpus is not None
        path = self.corpus.cache_path
        if not path.is_dir():
            raise ValueError(f"no corpus entry at {path}; call prepare_data() first (Trainer.fit does), with the same "
                             "corpus_sources, max_corpus_rows and data settings")
        verify_entry(path, vocab_size=self.vocab_size)  # as the answers' entry: checksums and token range
        tasks = dp.train_tasks()
        held = {tasks[i] for i in self.val_set["prompt_index"]} if self.val_set is not None else set()
        rows, stats = corpus_train_rows(path, self.corpus.tasks(), max_length=self.max_length, held_out=held)
        shift = len(dp.train)  # past every answer's prompt_index
        self._corpus_train = shift_row_ids(rows, shift)
        self.train_set = datasets.concatenate_datasets([self.train_set, self._corpus_train])
        self.stats["corpus"] = stats
        self.stats["rows"] = {"answers": self.stats["train_rows"], "corpus": len(rows), "row_id_shift": shift}
        self.stats["train_rows"] = len(self.train_set)

    def release_store(self) -> None:
        """Drop what only training reads, once no stage trains any more: the :attr:`store` (the rows'
        target features and soft labels, in host memory with ``feature_store="memory"``) and the last
        trainer Lightning attached, whose loaders' collators hold the store too. The rows themselves stay
        (:meth:`answer_token_rows`, :meth:`eval_prompts`); a later :meth:`setup` opens the store again.

        A trainer and its module reference each other: the collection pass here frees them, and the
        store with them, now rather than whenever the garbage collector next runs a full pass."""
        self.store = None
        self.trainer = None
        gc.collect()

    def answer_token_rows(self):
        """``(input_ids, loss_mask)`` of every training and validation row: what the draft vocabulary
        counts (exittrain/cpu_decode/draft_vocab.py). Opens no store."""
        self._split()
        return split_rows(self.train_set, self.val_set, "input_ids", "loss_mask")

    def _on_gpu(self) -> bool:
        """Whether the trainer this DataModule serves runs on CUDA (False before one is attached)."""
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _loader(self, rows: datasets.Dataset, **kwargs: Any) -> DataLoader:
        """Batches of ``rows`` from the :class:`Collator` (``kwargs``: the order). Batches are pinned in
        page-locked host memory when the trainer runs on a GPU, so their copy to it can overlap the step;
        nowhere else (a CPU run on a GPU host would start a CUDA context for nothing)."""
        if self.pad_token_id is None:
            raise ValueError("the DataModule is not set up; call setup() first")
        collate = Collator(pad_token_id=self.pad_token_id, max_length=self.max_length, store=self.store)
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return DataLoader(rows, batch_size=self.batch_size, collate_fn=collate, pin_memory=self._on_gpu(),
                          **workers, **kwargs)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; epoch e's order depends only on the order's seed (:attr:`order_seed`,
        else ``seed``) and e (:class:`ResumableSampler`).

        After ``load_state_dict`` (a resumed fit) the first pass continues the checkpoint's epoch
        right after the batches it had trained: a resumed run sees the same batches, in the same
        order, as a run that was never interrupted.
        """
        if self.train_set is None:
            raise ValueError("the DataModule is not set up; call setup('fit') first")
        # Bug fixed here: a RandomSampler with a generator seeded once per DataLoader replayed epoch 0's
        # order after every resume, from the start of the epoch (Lightning does not skip the batches a
        # plain DataLoader already gave before the checkpoint). See exittrain/data/sampler.py.
        world, rank = self._world()
        trainer = self.trainer
        epoch_fn = (lambda: trainer.current_epoch) if trainer is not None else None
        seed = self._order_settings()["seed"]
        sampler = ResumableSampler(self.train_set, seed=seed, num_replicas=world, rank=rank, epoch_fn=epoch_fn)
        if self._resume_order is not None:
            epoch, batches_done = self._resume_order
            sampler.resume(epoch, batches_done * self.batch_size)
            self._resume_order = None  # once: a later fit of the same DataModule starts afresh
        # its own generator, only for the workers' base seed: iterating never draws from torch's global RNG
        return self._loader(self.train_set, sampler=sampler, generator=torch.Generator().manual_seed(seed))

    def _world(self) -> tuple[int, int]:
        """(world size, global rank) of the attached trainer; (1, 0) without one."""
        trainer = self.trainer
        return (int(trainer.world_size), int(trainer.global_rank)) if trainer is not None else (1, 0)

    def _order_settings(self) -> dict[str, int]:
        """The settings that fix the training order besides the epoch."""
        seed = self.seed if self.order_seed is None else self.order_seed
        return {"seed": int(seed), "batch_size": int(self.batch_size), "world_size": self._world()[0]}

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data, saved in every checkpoint of a fit (Lightning hook).

        ``train_order``: the epoch and how many batches of it this rank has trained, read from
        Lightning's own counters at the moment the checkpoint is written (after the batch's update),
        plus the settings that fix the order (seed, batch size, world size).
        """
        trainer = self.trainer
        if trainer is None or self.train_set is None:
            return {}
        done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        return {"train_order": {"epoch": int(trainer.current_epoch), "batches_done": done, **self._order_settings()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the data order of a checkpoint (Lightning calls it before ``train_dataloader``).

        With another seed, batch size or world size the order cannot continue: the resumed run
        starts the checkpoint's epoch afresh (with a warning).
        """
        order = state_dict.get("train_order")
        if order:
            self._resume_order = resume_point(order, **self._order_settings())

    def val_dataloader(self) -> DataLoader | list:
        """Validation-loss batches over held-out training prompts; ``[]`` when ``val_fraction == 0``."""
        if self.val_set is None:
            return []
        return self._loader(self.val_set, shuffle=False)

    # -- evaluation prompts ------------------------------------------------------------------------

    def tokenizer(self) -> Any:
        """The target's tokenizer: the ``tokenizer`` argument, else the target provider's (cached)."""
        return self._target.tokenizer()

    def eval_prompt_texts(self, n: int | None = None) -> list[str]:
        """The first ``n`` evaluation prompts (all when None), never seen in training."""
        return self.plan.eval_texts(n)

    def eval_prompts(self, n: int | None = None) -> list[list[int]]:
        """The first ``n`` evaluation prompts as chat-templated token ids ending with the assistant header.

        Templated exactly like the training prompts (same ``generation.system_prompt``).
        """
        return self.plan.eval_ids(self.tokenizer(), n)
