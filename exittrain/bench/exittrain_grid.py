"""The arms of ``bench exittrain`` (:mod:`exittrain.bench.exittrain_arms`): what each trains, and the grid that runs.

An :class:`Arm` is one stage run from the shared warm start: ``pretrain`` (block CE only, the
matched control) when ``lambda_exit`` is 0, else ``exittrain`` (block CE + lambda x the node loss
on the arm's training tree, DDTree's best-first tree of ``budget_train`` nodes or the drafter's
greedy chain). Its :attr:`~Arm.name` says what differs, its :attr:`~Arm.control` names the matched
control (the same labels and rows, no node loss), and :meth:`~Arm.module_args` is what it changes
in the stage's module arguments: the tree shape and budget always, so a config's ``tree.shape``
changes no arm's shape. :data:`ARMS` is the grid that runs, a cut of the full factorial stated in
its comments; ``--arms`` picks from it (:func:`selected_arms`). Nothing here trains or measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from exittrain.core import TREE_SHAPES

__all__ = ["ARMS", "Arm", "replicate", "selected_arms", "split_replicate"]


@dataclass(frozen=True)
class Arm:
    """One arm: the stage it trains (``pretrain`` = block CE only) and what differs from the others.

    ``tree_shape``: the ExitTrain stage's training trees, ``ddtree`` (DDTree's best-first tree of
    ``budget_train`` nodes) or ``chain`` (the drafter's greedy chain, the draft vLLM and SGLang
    verify). A chain has one node per draft position: the module's chain takes ``min(budget_train,
    K)`` nodes, so the default ``budget_train`` (16 >= K) trains on the whole chain of K nodes.

    ``cpu_match``: a block-CE control that trains for the CPU-seconds of the arm it names rather than
    for the run's steps. Its step count is decided once per run from the CPU ratio measured on the
    first training seed, recorded and reused (:func:`exittrain.bench.exittrain_arms.cpu_matched_steps`).
    """

    labels: str = "soft"  # "soft" | "hard"
    rows: str = "fresh"  # "fresh" | "own"
    lambda_exit: float = 0.0  # 0: the block-CE control
    weight_type: str = "flow"
    budget_train: int = 16
    tree_shape: str = "ddtree"  # "ddtree" | "chain"
    lambda_tok: float = 1.0  # the block-CE weight: 0 trains on the node loss alone
    # a block-CE control trained for as many CPU-seconds as this arm (its name), not as many steps
    cpu_match: str | None = None

    def __post_init__(self) -> None:
        if self.lambda_tok <= 0 and self.lambda_exit <= 0:
            raise ValueError(f"Arm(lambda_tok={self.lambda_tok}, lambda_exit={self.lambda_exit}): no loss; an arm "
                             "needs block CE (lambda_tok > 0), the node loss (lambda_exit > 0) or both")
        if self.tree_shape not in TREE_SHAPES:
            raise ValueError(f"Arm(tree_shape={self.tree_shape!r}): the training tree shape must be one of "
                             f"{TREE_SHAPES}")
        if self.cpu_match is not None and self.lambda_exit > 0:
            raise ValueError(f"Arm(cpu_match={self.cpu_match!r}, lambda_exit={self.lambda_exit}): only a block-CE "
                             "control (lambda_exit = 0) is trained for another arm's CPU-seconds")

    @property
    def stage(self) -> str:
        return "exittrain" if self.lambda_exit > 0 else "pretrain"

    @property
    def name(self) -> str:
        """``control-<labels>-<rows>[-cpumatched]``,
        ``exittrain-<labels>-<weights>-l<lambda>[-B<budget> | -chain]-<rows>``, or
        ``nodeonly-<weights>-l<lambda>[...]-<rows>`` without block CE (no labels to name). A chain's size
        is the drafter's K, not the budget: it gets no ``-B`` suffix."""
        if self.stage == "pretrain":
            return f"control-{self.labels}-{self.rows}" + ("" if self.cpu_match is None else "-cpumatched")
        if self.tree_shape == "chain":
            tree = "-chain"
        else:
            tree = "" if self.budget_train == 16 else f"-B{self.budget_train}"
        loss = f"exittrain-{self.labels}" if self.lambda_tok > 0 else "nodeonly"
        return f"{loss}-{self.weight_type}-l{self.lambda_exit:g}{tree}-{self.rows}"

    @property
    def control(self) -> str:
        """The name of the matched control: the same labels and rows, no node loss (and so no tree). A
        node-only arm's is the soft-label control: the block-CE stage it replaces."""
        return Arm(labels=self.labels, rows=self.rows).name

    def module_args(self) -> dict:
        """What the arm changes in the stage's module arguments. ``tree_shape`` and ``budget`` are always
        passed, so an arm trains on its own shape whatever the config's ``tree.shape`` says (``+serve=dflash``
        sets chain); a chain arm passes its ``budget_train`` too, of which the module's chain uses min(budget, K)."""
        args = {"soft_label_weight": 1.0 if self.labels == "soft" else 0.0, "vocab_sample": None,
                "budget": self.budget_train, "tree_shape": self.tree_shape}
        if self.stage == "exittrain":
            args.update(lambda_exit=self.lambda_exit, weight_type=self.weight_type, lambda_tok=self.lambda_tok)
        else:
            args["analytic_every"] = 0
        return args


# The grid that runs: a cut of the factorial (2 labels x 2 lambdas x 2 weights x 2 rows x
# 2 budgets = 32 ExitTrain arms on DDTree's tree) to the ones that answer its questions on a CPU:
# each label kind at the reference's lambda 0.1 and at 1 (flow), the missing weights at 1, the
# training budget 32 once, the warm start's own rows once against their own control (at lambda 1),
# and the chain once (soft, flow, lambda 1): the serving profile's stage against the tree's.
ARMS = (
    Arm("soft"),
    Arm("hard"),
    Arm("soft", lambda_exit=0.1),
    Arm("soft", lambda_exit=1.0),  # tree ExitTrain (B = 16)
    # chain ExitTrain: the stage `+serve=dflash` trains (the K-node chain vLLM and SGLang verify)
    Arm("soft", lambda_exit=1.0, tree_shape="chain"),
    Arm("soft", lambda_exit=1.0, weight_type="missing"),
    Arm("hard", lambda_exit=0.1),  # the reference recipe: hard-label CE + 0.1 x flow
    Arm("hard", lambda_exit=1.0),
    Arm("soft", lambda_exit=1.0, budget_train=32),
    Arm("soft", rows="own"),
    Arm("soft", rows="own", lambda_exit=1.0),
    # the node loss alone (flow, lambda 1, no block CE): with the control and tree ExitTrain it splits
    # ExitTrain's gain into block CE's and the node loss's (docs/experiments, Part B)
    Arm(lambda_exit=1.0, lambda_tok=0.0),
    # block CE for the node-only arm's CPU-seconds (its steps: the steps x the CPU ratio the run records,
    # exittrain_arms.cpu_matched_steps): is the node loss better than block CE given the same compute?
    Arm(cpu_match="nodeonly-flow-l1-fresh"),
)


def selected_arms(args) -> list[Arm]:
    """The arms of ``--arms`` (all of :data:`ARMS` by default), in the grid's order."""
    return [a for a in ARMS if args.arms is None or a.name in args.arms]


def replicate(name: str, seed: int | None) -> str:
    """The drafter name of ``name``'s replicate trained under ``seed`` (``name@seed<seed>``); ``name`` itself
    for None (a run without ``--train-seeds``: one replicate, under the bench's ``--seed``)."""
    return name if seed is None else f"{name}@seed{seed}"


def split_replicate(name: str) -> tuple[str, int | None]:
    """``(arm name, training seed)`` of a drafter name :func:`replicate` made; the seed is None without one."""
    base, sep, seed = name.partition("@seed")
    return (base, int(seed)) if sep else (name, None)
