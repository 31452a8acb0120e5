"""PNG plots of decoding and training results, from plain Python data (lists and dicts of numbers).

Every function takes the data and an output ``path``, writes one PNG (creating parent folders)
and returns the path. They use matplotlib's object API with the Agg canvas (no pyplot, no
display, no global backend switch), so they are safe in headless jobs and threads.

- :func:`plot_tau_vs_budget`: tau against tree budget, one line per arm, 95% CI error bars,
  dashed oracle bound ``tau_oracle``; takes :func:`exittrain.heldout.decode_eval.summarize` rows.
- :func:`plot_block_length_histogram`: normalised histogram of per-round block lengths.
- :func:`plot_exit_mass_by_depth`: exit mass by depth 0..K (docs/algorithm.md section 4).
- :func:`plot_draft_tree`: one draft tree (from :func:`exittrain.heldout.tree_example.tree_example`)
  with reach P as node colour, exit mass E as annotation and marker, the accepted path in red.
- :func:`plot_training_curves`: a validation metric (e.g. ``val/block_length``) over steps.
- :func:`plot_grouped_bars`: one value per (group, series), e.g. tau relative to the control arm
  per domain, or the verifier's time per round per budget; an optional reference line.
- :func:`plot_learning_curve`: ``bench curve``'s served tau against training CPU-seconds and against
  training tokens, one line per recipe, the 95% intervals as bands.

Bad input (nothing to plot, missing keys) raises ValueError naming what is missing; a series
that is empty is skipped with a warning (:mod:`warnings`), never silently.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
from matplotlib import cm, colors
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

__all__ = [
    "plot_tau_vs_budget",
    "plot_block_length_histogram",
    "plot_exit_mass_by_depth",
    "plot_draft_tree",
    "plot_training_curves",
    "plot_grouped_bars",
    "plot_learning_curve",
    "tree_layout",
    "display_token",
    "series_name",
]

PathLike = str | os.PathLike
DPI = 110
_COLORS = [f"C{i}" for i in range(10)]


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def series_name(row: Mapping, with_temperature: bool = False) -> str:
    """The name of a row's series: ``series``, else ``arm``, else ``label``, else ``"-"``.

    With ``with_temperature`` the temperature is appended (``"exittrain T=0.7"``).
    """
    name = row.get("series") or row.get("arm") or row.get("label") or "-"
    if with_temperature and "temperature" in row:
        name = f"{name} T={float(row['temperature']):g}"
    return str(name)


# ----------------------------------------------------------------------------------------------
# tau vs budget


def plot_tau_vs_budget(
    rows: Sequence[Mapping],
    path: PathLike,
    title: str = "Mean block length tau vs tree budget",
) -> Path:
    """Tau against the tree budget B, one line per series (:func:`series_name`).

    ``rows``: dicts with ``budget`` and ``tau``; optional ``ci95`` ([lo, hi], drawn as error
    bars), ``tau_oracle`` (drawn dashed in the series colour), ``label`` / ``arm`` / ``series``
    and ``temperature`` (appended to the series name when the rows hold several temperatures).
    Summary rows of :func:`~exittrain.heldout.decode_eval.summarize` fit as they are. The x axis is
    log2 when the budgets span a factor of 4 or more; series are offset slightly sideways so
    that their error bars stay apart.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("plot_tau_vs_budget: no rows to plot (need dicts with 'budget' and 'tau')")
    for r in rows:
        missing = [k for k in ("budget", "tau") if k not in r]
        if missing:
            raise ValueError(f"plot_tau_vs_budget: a row lacks {missing}: {dict(r)}")
    several_t = len({float(r.get("temperature", 0.0)) for r in rows}) > 1
    series: dict[str, list[Mapping]] = {}
    for r in rows:
        series.setdefault(series_name(r, several_t), []).append(r)

    oracles = {
        name: tuple((r["budget"], float(r["tau_oracle"])) for r in sorted(items, key=lambda r: r["budget"])
                    if r.get("tau_oracle") is not None)
        for name, items in series.items()
    }
    oracles = {name: pts for name, pts in oracles.items() if pts}
    shared_oracle = len(set(oracles.values())) == 1  # the oracle does not depend on the drafter: draw it once

    fig = _new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    budgets = sorted({r["budget"] for r in rows})
    log_x = budgets[-1] >= 4 * budgets[0]
    for i, (name, items) in enumerate(series.items()):
        items = sorted(items, key=lambda r: r["budget"])
        color = _COLORS[i % len(_COLORS)]
        shift = 0.04 * (i - (len(series) - 1) / 2)  # small horizontal offset so error bars do not overlap
        xs = [r["budget"] * 2**shift if log_x else r["budget"] + shift * budgets[-1] / 4 for r in items]
        ys = [float(r["tau"]) for r in items]
        ci = [r.get("ci95") for r in items]
        if all(c is not None and len(c) == 2 for c in ci):
            yerr = [[max(0.0, y - c[0]) for y, c in zip(ys, ci)], [max(0.0, c[1] - y) for y, c in zip(ys, ci)]]
            ax.errorbar(xs, ys, yerr=yerr, color=color, marker="o", capsize=4, label=f"{name} (95% CI)")
        else:
            ax.plot(xs, ys, color=color, marker="o", label=name)
        if name in oracles and not shared_oracle:
            ax.plot(*zip(*oracles[name]), color=color, linestyle="--", marker="x", label=f"{name}: oracle bound")
    if oracles and shared_oracle:
        ax.plot(*zip(*next(iter(oracles.values()))), color="0.25", linestyle="--", marker="x",
                label="oracle bound tau_oracle")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget B (draft nodes per round)")
    ax.set_ylabel("tau (tokens per round, bonus included)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# block-length histogram


def plot_block_length_histogram(
    block_lengths_by_label: Mapping[str, Sequence[int]],
    path: PathLike,
    title: str = "Block length per round",
) -> Path:
    """Normalised histogram (fraction of rounds) of per-round block lengths, one bar series per label.

    Each series' mean is marked with a dashed vertical line and given in the legend with its
    number of rounds. Empty series are skipped with a warning; ValueError if all are empty.
    """
    data = {}
    for label, lengths in block_lengths_by_label.items():
        lengths = [int(x) for x in lengths]
        if not lengths:
            warnings.warn(f"plot_block_length_histogram: series {label!r} has no rounds; skipped", stacklevel=2)
            continue
        data[label] = lengths
    if not data:
        raise ValueError("plot_block_length_histogram: no block lengths to plot (every series is empty)")
    lo = min(min(v) for v in data.values())
    hi = max(max(v) for v in data.values())
    values = list(range(lo, hi + 1))
    width = 0.8 / len(data)
    fig = _new_figure(max(6.0, 0.5 * len(values) * max(1, len(data)) ** 0.5 + 3), 4.5)
    ax = fig.add_subplot()
    for i, (label, lengths) in enumerate(data.items()):
        color = _COLORS[i % len(_COLORS)]
        n = len(lengths)
        frac = [sum(1 for x in lengths if x == v) / n for v in values]
        offset = (i - (len(data) - 1) / 2) * width
        mean = sum(lengths) / n
        ax.bar([v + offset for v in values], frac, width=width, color=color, alpha=0.85,
               label=f"{label} (mean {mean:.2f}, {n} rounds)")
        ax.axvline(mean, color=color, linestyle="--", linewidth=1.5)
    ax.set_xticks(values)
    ax.set_xlabel("block length (accepted draft tokens + bonus)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(title + "  (dashed: mean)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# exit mass by depth


def plot_exit_mass_by_depth(
    exit_mass_by_label: Mapping[str, Sequence[float]],
    path: PathLike,
    title: str = "Exit mass by depth",
) -> Path:
    """Grouped bars of exit mass E by exit depth d = 0..K (list index = depth), one series per label.

    The legend gives each series' total and mean exit depth ``sum_d d E_d`` (expected accepted
    draft tokens). Empty series are skipped with a warning; ValueError if all are empty.
    """
    data = {}
    for label, masses in exit_mass_by_label.items():
        masses = [float(m) for m in masses]
        if not masses:
            warnings.warn(f"plot_exit_mass_by_depth: series {label!r} is empty; skipped", stacklevel=2)
            continue
        data[label] = masses
    if not data:
        raise ValueError("plot_exit_mass_by_depth: no exit masses to plot (every series is empty)")
    depth_count = max(len(v) for v in data.values())
    width = 0.8 / len(data)
    fig = _new_figure(max(6.0, 0.6 * depth_count * max(1, len(data)) ** 0.5 + 3), 4.5)
    ax = fig.add_subplot()
    for i, (label, masses) in enumerate(data.items()):
        offset = (i - (len(data) - 1) / 2) * width
        mean_depth = sum(d * m for d, m in enumerate(masses))
        ax.bar([d + offset for d in range(len(masses))], masses, width=width, color=_COLORS[i % len(_COLORS)],
               label=f"{label} (sum {sum(masses):.2f}, mean exit depth {mean_depth:.2f})")
    ax.set_xticks(range(depth_count))
    ax.set_xlabel("exit depth d (0 = root: no draft token accepted)")
    ax.set_ylabel("exit mass E (probability the round exits at depth d)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_grouped_bars(
    values: Mapping[str, Mapping[str, float]],
    path: PathLike,
    *,
    title: str,
    ylabel: str,
    reference: float | None = None,
    reference_label: str = "",
    errors: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
) -> Path:
    """Bars of ``values[group][series]``: one cluster per group, one colour per series, value on top.

    ``reference`` draws a dashed horizontal line (e.g. 1.0 for ratios, or a goal). ``errors``
    (same keys, ``(lo, hi)``) draws interval whiskers. ValueError if there is nothing to plot.
    """
    groups = [g for g, row in values.items() if row]
    if not groups:
        raise ValueError(f"plot_grouped_bars: no values to plot for {title!r}")
    series = list(dict.fromkeys(s for g in groups for s in values[g]))
    width = 0.8 / len(series)
    fig = _new_figure(max(6.0, 1.2 * len(groups) * max(1, len(series)) ** 0.5 + 3), 4.5)
    ax = fig.add_subplot()
    for i, name in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, g in enumerate(groups) if name in values[g]]
        ys = [float(values[g][name]) for g in groups if name in values[g]]
        bars = ax.bar(xs, ys, width=width, color=_COLORS[i % len(_COLORS)], label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        if errors:
            spans = [errors.get(g, {}).get(name) for g in groups if name in values[g]]
            for x, span in zip(xs, spans):
                if span is not None:
                    ax.plot([x, x], [span[0], span[1]], color="black", linewidth=1)
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1, label=reference_label or None)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# training curves


def _curve_points(points) -> list[tuple[float, float]]:
    out = []
    for p in points:
        if isinstance(p, Mapping):
            value = p.get("block_length", p.get("val/block_length", p.get("value")))
            if "step" not in p or value is None:
                raise ValueError(f"plot_training_curves: an entry lacks 'step' or 'block_length'/'value': {dict(p)}")
            out.append((float(p["step"]), float(value)))
        else:
            step, value = p
            out.append((float(step), float(value)))
    return sorted(out)


def plot_training_curves(
    history: Mapping[str, Sequence],
    path: PathLike,
    title: str = "Held-out block length during training",
    ylabel: str = "val/block_length (tau)",
    stage_starts: Mapping[str, float] | None = None,
) -> Path:
    """A validation metric over training steps, one line per label (e.g. per stage).

    ``history``: label -> entries, each ``{"step", "block_length"}`` (the
    :class:`~exittrain.lit.callbacks.DecodeEvalCallback` history), ``{"step", "val/block_length"}``,
    ``{"step", "value"}`` (``report`` gives the frequent cheap measures of
    :class:`~exittrain.lit.heldout_callback.HeldOutBlockLengthCallback` so, one series each) or a
    ``(step, value)`` pair. ``stage_starts``: label -> step where that stage begins, drawn as a dotted
    vertical line. Empty series are skipped with a warning.
    """
    data = {}
    for label, points in history.items():
        pts = _curve_points(points)
        if not pts:
            warnings.warn(f"plot_training_curves: series {label!r} is empty; skipped", stacklevel=2)
            continue
        data[label] = pts
    if not data:
        raise ValueError("plot_training_curves: no history to plot (every series is empty)")
    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    for i, (label, pts) in enumerate(data.items()):
        color = _COLORS[i % len(_COLORS)]
        ax.plot(*zip(*pts), color=color, marker="o", markersize=3, label=label)
        if stage_starts and label in stage_starts and stage_starts[label] > 0:
            ax.axvline(stage_starts[label], color=color, linestyle=":", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


_CURVE_KEYS = ("recipe", "cpu_s", "train_tokens", "chain_tau", "chain_ci95", "tree_tau", "tree_ci95")


def plot_learning_curve(result: Mapping, path: PathLike) -> Path:
    """``bench curve``'s result (:func:`exittrain.bench.curve.result_of`): two panels, the served tau
    against training CPU-seconds (the data step included) and against training tokens. Per recipe one
    colour: the chain tau at K as a solid line, the tree tau at the budget dashed, each with its 95%
    interval as a band. ValueError for no points or a point without one of the keys it plots."""
    points = list(result.get("points") or [])
    if not points:
        raise ValueError("plot_learning_curve: the result has no points")
    by_recipe: dict[str, list[Mapping]] = {}
    for i, p in enumerate(points):
        missing = [k for k in _CURVE_KEYS if k not in p]
        if missing:
            raise ValueError(f"plot_learning_curve: point {i} lacks {', '.join(missing)}")
        by_recipe.setdefault(p["recipe"], []).append(p)
    K, budget = points[0].get("chain_K", "K"), result.get("budget", points[0].get("budget", "B"))
    fig = _new_figure(11.0, 4.5)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, x_key, x_label in ((axes[0], "cpu_s", "training CPU-seconds (data step included)"),
                               (axes[1], "train_tokens", "training tokens")):
        for i, (recipe, pts) in enumerate(by_recipe.items()):
            color = _COLORS[i % len(_COLORS)]
            x = [float(p[x_key]) for p in pts]
            for key, style, name in (("chain", "-", f"chain K={K}"), ("tree", "--", f"tree B={budget}")):
                ax.plot(x, [p[f"{key}_tau"] for p in pts], style, color=color, marker="o", markersize=3,
                        label=f"{recipe}, {name}")
                ax.fill_between(x, [p[f"{key}_ci95"][0] for p in pts], [p[f"{key}_ci95"][1] for p in pts],
                                color=color, alpha=0.12, linewidth=0)
        ax.set_xlabel(x_label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("served tau (tokens per round, pooled)")
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(f"Served tau against training cost, T = {float(points[0].get('temperature', 0.0)):g} "
                 "(bands: 95% intervals over prompts)")
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# draft tree


def display_token(text: str, max_chars: int = 10) -> str:
    """A short, visible form of a token text: spaces at either end as ``␣``, newlines escaped, cut to ``max_chars``."""
    text = str(text).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    stripped = text.strip(" ")
    if stripped != text:
        lead = len(text) - len(text.lstrip(" "))
        trail = len(text) - len(text.rstrip(" "))
        text = "␣" * lead + stripped + "␣" * trail if stripped else "␣" * len(text)
    if len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return text or "∅"


def _prob(x: float) -> str:
    """3 decimals, or 1 significant digit in scientific notation below 0.001 (0 stays "0")."""
    if x == 0:
        return "0"
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.0e}"


_TREE_KEYS = ("tokens", "parents", "depths", "reach", "exit_mass")


def _check_example(example: Mapping) -> int:
    missing = [k for k in _TREE_KEYS if k not in example]
    if missing:
        raise ValueError(f"plot_draft_tree: the example lacks {missing}; build it with exittrain.heldout.tree_example")
    n = len(example["tokens"])
    if n == 0:
        raise ValueError("plot_draft_tree: the tree has no nodes")
    if len(example["parents"]) != n or len(example["depths"]) != n:
        raise ValueError("plot_draft_tree: tokens, parents and depths must have one entry per node")
    if len(example["reach"]) != n + 1 or len(example["exit_mass"]) != n + 1:
        raise ValueError(f"plot_draft_tree: reach and exit_mass need {n + 1} entries (root first), "
                         f"got {len(example['reach'])} and {len(example['exit_mass'])}")
    for j, p in enumerate(example["parents"], start=1):
        if not 0 <= int(p) < j:
            raise ValueError(f"plot_draft_tree: node {j} has parent {p}; parents must precede children (0 = root)")
    return n


def tree_layout(example: Mapping) -> list[tuple[float, float]]:
    """Layered layout of the tree: (x, y) per row, root first (row j = node j).

    x is the depth (root 0); leaves get y = 0, 1, 2, ... in depth-first order with siblings in
    node order (the drafter's best-first order); a parent sits at the middle of its first and
    last child. Every node of the example gets a position.
    """
    n = _check_example(example)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for j, p in enumerate(example["parents"], start=1):
        children[int(p)].append(j)
    pos: list[tuple[float, float] | None] = [None] * (n + 1)
    next_leaf = 0.0
    depth = [0] + [int(d) for d in example["depths"]]
    # iterative post-order DFS (a recursion would be fine for K <= 16, but a deep chain should not fail)
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        row, done = stack.pop()
        if not children[row]:
            pos[row] = (float(depth[row]), next_leaf)
            next_leaf += 1.0
        elif done:
            ys = [pos[c][1] for c in children[row]]
            pos[row] = (float(depth[row]), (ys[0] + ys[-1]) / 2)
        else:
            stack.append((row, True))
            stack.extend((c, False) for c in reversed(children[row]))
    return list(pos)  # every row was placed: the DFS reaches all rows from the root


def plot_draft_tree(example: Mapping, path: PathLike, *, max_chars: int = 10, log_color: bool = True) -> Path:
    """Draw one draft tree: root at the left, one column per depth.

    ``example``: the dict of :func:`exittrain.heldout.tree_example.tree_example` (required keys
    ``tokens``, ``parents``, ``depths``, ``reach`` and ``exit_mass`` root-first; optional
    ``token_texts``, ``root_text``, ``accepted_rows``, ``exit_row``, ``bonus_text``,
    ``expected_block_length``, ``coverage``, ``budget``, ``max_depth``, ``law_temperature``,
    ``prompt_text``). Each node box shows its token text (:func:`display_token`), reach P and exit
    mass E; the box colour is P (log scale from 1e-3 with ``log_color``, else linear), with a
    colorbar; an orange disc right of the box has area proportional to E; the accepted path is
    drawn in red and the exit node is starred. The figure grows with the number of leaves and the
    depth, so trees of 32+ nodes stay legible.
    """
    n = _check_example(example)
    layout = tree_layout(example)
    reach = [float(x) for x in example["reach"]]
    exit_mass = [float(x) for x in example["exit_mass"]]
    texts = example.get("token_texts") or [str(t) for t in example["tokens"]]
    root_text = example.get("root_text", "root")
    labels = [display_token(root_text, max_chars)] + [display_token(t, max_chars) for t in texts]
    accepted = [int(r) for r in example.get("accepted_rows") or []]
    on_path = {0, *accepted}
    exit_row = example.get("exit_row", accepted[-1] if accepted else None)

    K = max(int(d) for d in example["depths"])
    leaves = max(y for _, y in layout) + 1
    fig = _new_figure(1.85 * (K + 1) + 2.6, max(4.0, 0.5 * leaves + 2.0))
    ax = fig.add_subplot()
    norm = colors.LogNorm(vmin=1e-3, vmax=1.0, clip=True) if log_color else colors.Normalize(0.0, 1.0)
    cmap = matplotlib.colormaps["viridis"]
    # edges
    for j, p in enumerate(example["parents"], start=1):
        (x0, y0), (x1, y1) = layout[int(p)], layout[j]
        red = j in on_path and int(p) in on_path and j in accepted
        ax.plot([x0, x0 + 0.5, x1], [y0, y1, y1], color="tab:red" if red else "0.6",
                linewidth=2.8 if red else 1.0, zorder=1, solid_joinstyle="round")
    # nodes
    e_scale = 700.0
    for row, (x, y) in enumerate(layout):
        face = cmap(norm(max(reach[row], 1e-12)))
        luminance = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2]
        txt = f"{labels[row]}\nP={_prob(reach[row])}  E={_prob(exit_mass[row])}"
        ax.text(x, y, txt, ha="center", va="center", fontsize=8, zorder=3, parse_math=False, linespacing=1.5,
                color="black" if luminance > 0.5 else "white",
                fontweight="bold" if row == 0 else "normal",
                bbox=dict(boxstyle="round,pad=0.3", facecolor=face,
                          edgecolor="tab:red" if row in on_path else "0.3", linewidth=2.2 if row in on_path else 0.8))
        if exit_mass[row] > 0:
            ax.scatter([x + 0.38], [y], s=[e_scale * exit_mass[row]], color="tab:orange", alpha=0.8,
                       edgecolors="0.2", linewidths=0.5, zorder=4)
        if exit_row is not None and row == int(exit_row):
            ax.scatter([x - 0.36], [y], s=160, marker="*", color="tab:red", zorder=4)
    ax.set_xlim(-0.6, K + 0.7)
    ax.set_ylim(leaves - 0.4, -0.6)
    ax.set_xticks(range(K + 1), ["root"] + [f"depth {d}" for d in range(1, K + 1)])
    ax.set_xlabel("depth (draft tokens after the root)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    bar = fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=min(1.0, 6.0 / max(leaves, 6) + 0.3))
    bar.set_label("reach probability P(v)" + (" (log scale)" if log_color else ""))

    handles = [
        Line2D([], [], color="tab:red", linewidth=2.8, label="accepted path"),
        Line2D([], [], marker="*", color="tab:red", linestyle="", markersize=12, label="exit node"),
        Line2D([], [], marker="o", color="tab:orange", linestyle="", markersize=10,
               label="exit mass E (disc area)"),
    ]
    ax.legend(handles=handles, loc="lower right", fontsize=8, framealpha=0.9)
    ebl = example.get("expected_block_length", sum(reach))
    cov = example.get("coverage", sum(reach[1:]))
    head = f"Draft tree after root {display_token(root_text, 24)!r}: B={example.get('budget', n)}, K={K}"
    law_t = example.get("law_temperature")
    stats = f"E[block length] = ΣP = {ebl:.3f}    coverage C = {cov:.3f}    ΣE = {sum(exit_mass):.3f}"
    if law_t is not None:
        stats += f"    (law at T={float(law_t):g})"
    path_txt = ""
    if accepted or "bonus_text" in example:
        toks = " | ".join(display_token(texts[r - 1], 16) for r in accepted)
        path_txt = f"\naccepted: [{toks}] + bonus {display_token(example.get('bonus_text', '?'), 16)!r}"
    prompt = example.get("prompt_text")
    if prompt:
        prompt = str(prompt).replace("\n", "\\n")
        path_txt += f"\nprompt tail: …{prompt[-70:]}"
    ax.set_title(f"{head}\n{stats}{path_txt}", fontsize=9, loc="left", parse_math=False)
    return _save(fig, path)

