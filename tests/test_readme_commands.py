"""The commands that README.md and the guides in docs/ show exist: every ``python -m exittrain
VERB`` names a command of exittrain/__main__.py, every ``bench NAME`` a benchmark of
:data:`exittrain.bench.registry.BENCHES`, every ``make TARGET`` a target of the Makefile, every
``+recipe=X`` a file recipes/X.yaml, every ``+experiment=X`` a file conf/experiment/X.yaml, and
every config-group choice (``trainer=ddp``, ``+serve=dflash``) a file of that group in conf/.

Only code is read (fenced blocks and inline code spans), so prose such as "what makes a round
cheaper" is not taken for a make command. All-capital words (``+recipe=NAME``) are placeholders.
Offline and fast: no Hydra composition, nothing imported but the command tables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from exittrain.__main__ import HYDRA_COMMANDS, PLAIN_COMMANDS
from exittrain.bench.registry import BENCHES

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_VERB = re.compile(r"python\s+-m\s+exittrain\s+([^\s`'\"]+)")
_BENCH = re.compile(r"(?:python\s+-m\s+exittrain\s+|^)bench\s+([^\s`'\"]+)")
_MAKE = re.compile(r"(?:^|[\s;&|(])make\s+([A-Za-z0-9_][\w.-]*)")
# ``+recipe=code``, ``'+recipe=dialogue,code,math'``, ``trainer=ddp``; a value with / or . is a path
_CHOICE = re.compile(r"(?<![\w.\-/])(\+{0,2})([a-z_]+)=([\w,]+)(?=[\s'\"`]|$)")
_MAKE_TARGET = re.compile(r"^([A-Za-z0-9_][\w.-]*(?:\s+[A-Za-z0-9_][\w.-]*)*)\s*:(?!=)", re.M)


@dataclass(frozen=True)
class Known:
    """What a command line may name."""

    verbs: frozenset[str]
    benches: frozenset[str]
    make_targets: frozenset[str]
    groups: dict[str, frozenset[str] | None]  # group -> its option names; None: the folder does not exist


def code_lines(markdown: str) -> list[str]:
    """Every line of the fenced blocks, then every inline code span outside them; a line ending in
    a backslash is joined with the next, as the shell does."""
    blocks = [m.group(2) for m in _FENCE.finditer(markdown)]
    prose = _FENCE.sub("", markdown)
    lines = []
    for block in blocks:
        lines += block.replace("\\\n", " ").splitlines()
    lines += _INLINE_CODE.findall(prose)
    return [line.strip() for line in lines if line.strip()]


def makefile_targets(makefile: str) -> frozenset[str]:
    """The targets a ``make TARGET`` may name (variable assignments ``X := ...`` are not targets)."""
    targets = set()
    for match in _MAKE_TARGET.finditer(makefile):
        targets.update(t for t in match.group(1).split() if not t.startswith("."))
    return frozenset(targets)


def group_options(conf: Path, group: str) -> frozenset[str] | None:
    folder = conf / group
    return frozenset(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else None


def known(root: Path = ROOT) -> Known:
    conf = root / "conf"
    groups: dict[str, frozenset[str] | None] = {
        g.name: group_options(conf, g.name) for g in conf.iterdir() if g.is_dir()
    }
    groups["recipe"] = group_options(root, "recipes")
    groups.setdefault("experiment", None)
    return Known(
        verbs=frozenset(HYDRA_COMMANDS) | frozenset(PLAIN_COMMANDS),
        benches=frozenset(BENCHES),
        make_targets=makefile_targets((root / "Makefile").read_text(encoding="utf-8")),
        groups=groups,
    )


def _placeholder(word: str) -> bool:
    return word.isupper() or word in ("...",)


def command_problems(markdown: str, ok: Known) -> list[str]:
    """``what: why`` for every command in the code of ``markdown`` that names nothing that exists."""
    bad = []
    for line in code_lines(markdown):
        for verb in _VERB.findall(line):
            if verb not in ok.verbs and not _placeholder(verb):
                bad.append(f"python -m exittrain {verb}: not a command of exittrain/__main__.py")
        for name in _BENCH.findall(line):
            for one in name.strip("{}").split(","):
                if one not in ok.benches and not _placeholder(one):
                    bad.append(f"bench {one}: not in exittrain.bench.registry.BENCHES")
        for target in _MAKE.findall(line):
            if target not in ok.make_targets and not _placeholder(target):
                bad.append(f"make {target}: no such target in the Makefile")
        if not (_VERB.search(line) or re.match(r"(?:make|bench|nohup)\b", line) or line.startswith("+")):
            continue  # group choices only on command lines and in override spans
        for plus, group, values in _CHOICE.findall(line):
            if group not in ok.groups:
                continue  # a plain key (seed=1, warm_start=...), not a config group
            options = ok.groups[group]
            for value in filter(None, values.split(",")):
                if _placeholder(value) or value == "null":
                    continue
                where = "recipes" if group == "recipe" else f"conf/{group}"
                if options is None:
                    bad.append(f"{plus}{group}={value}: {where}/ does not exist")
                elif value not in options:
                    bad.append(f"{plus}{group}={value}: no {where}/{value}.yaml")
    return bad


def guides(root: Path = ROOT) -> list[Path]:
    """README.md and the guides of docs/ (the dated notebook keeps its commands as they were)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", guides(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_shown_exists(page):
    ok = known()
    text = page.read_text(encoding="utf-8")
    problems = command_problems(text, ok)
    if ok.groups["experiment"] is None:
        missing = [p for p in problems if p.startswith("+experiment=")]
        problems = [p for p in problems if not p.startswith("+experiment=")]
        assert not problems, "\n".join(problems)
        if missing:
            pytest.skip("conf/experiment/ does not exist yet: the +experiment presets of "
                        f"{page.name} are not checked ({', '.join(sorted(set(missing)))})")
    assert not problems, "\n".join(problems)


def test_the_readme_shows_the_commands():
    """The front door names every command a user runs, and the set-up targets."""
    lines = code_lines((ROOT / "README.md").read_text(encoding="utf-8"))
    verbs = {v for line in lines for v in _VERB.findall(line)}
    assert verbs >= set(HYDRA_COMMANDS) | set(PLAIN_COMMANDS), sorted(set(HYDRA_COMMANDS) | set(PLAIN_COMMANDS) - verbs)
    targets = {t for line in lines for t in _MAKE.findall(line)}
    assert {"setup", "fit"} <= targets


def test_the_checker_flags_what_does_not_exist(tmp_path):
    (tmp_path / "conf" / "trainer").mkdir(parents=True)
    (tmp_path / "conf" / "trainer" / "ddp.yaml").write_text("strategy: ddp\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "code.yaml").write_text("# @package _global_\n")
    (tmp_path / "Makefile").write_text("PY := python\n.PHONY: fit\nfit: setup  ## train\n\techo\nsetup:\n")
    ok = known(tmp_path)
    assert ok.make_targets == {"fit", "setup"}
    readme = (
        "What makes a round cheaper, in prose, is not a make target.\n\n"
        "```bash\n"
        "make setup && make fit\n"
        "make deploy                                   # no such target\n"
        "python -m exittrain fit +recipe=code trainer=ddp seed=1 warm_start=RUN/drafter\n"
        "python -m exittrain train +recipe=code        # no such verb\n"
        "python -m exittrain fit -m '+recipe=code,poetry' \\\n"
        "    trainer=tpu                               # no such recipe, no such trainer\n"
        "python -m exittrain bench decode --drafter D\n"
        "python -m exittrain bench speed               # no such benchmark\n"
        "python -m exittrain fit +recipe=NAME +experiment=big   # a placeholder; no conf/experiment\n"
        "```\n\n"
        "Also `bench decode --decode auto`, `bench {decode,nope}` and `python -m exittrain.serve.check`.\n"
    )
    assert command_problems(readme, ok) == [
        "make deploy: no such target in the Makefile",
        "python -m exittrain train: not a command of exittrain/__main__.py",
        "+recipe=poetry: no recipes/poetry.yaml",
        "trainer=tpu: no conf/trainer/tpu.yaml",
        "bench speed: not in exittrain.bench.registry.BENCHES",
        "+experiment=big: conf/experiment/ does not exist",
        "bench nope: not in exittrain.bench.registry.BENCHES",
    ]
