"""The default prompt sources of each domain, read from the data configs (``conf/data/*.yaml``).

A data config lists what a recipe trains and evaluates on (``train_sources``, ``eval_sources``:
prompt source specs, :mod:`exittrain.data.source_spec`). The same lists are the defaults of a
library caller that passes no sources (``load_domain("code")``,
``ExitTrainDataModule(domain="code")``), so there is one copy of them: the config. A data config
whose lists are null names no default domain; its ``domain`` (else its file name) keys
:data:`DOMAIN_SOURCES`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from exittrain.configs import CONF_DIR

__all__ = ["DATA_CONF_DIR", "DOMAIN_SOURCES", "HUB_SOURCES", "DomainSources", "read_domain_sources"]

DATA_CONF_DIR = CONF_DIR / "data"  # the checkout's conf/data, or the copy packaged in the wheel
"""The data config group, whose lists are the domains' defaults."""


@dataclass(frozen=True)
class DomainSources:
    """The default train and evaluation sources of one domain (spec strings or mappings)."""

    train: tuple[str | Mapping[str, Any], ...]
    eval: tuple[str | Mapping[str, Any], ...]


def read_domain_sources(conf_dir: Path = DATA_CONF_DIR) -> dict[str, DomainSources]:
    """``domain -> DomainSources`` of every data config in ``conf_dir`` that lists its sources.

    Raises ValueError naming the file when a config gives one list without the other, a list that
    is empty or not a list, or a domain that another config defines too; and naming the folder
    when no config there lists any source.
    """
    out: dict[str, DomainSources] = {}
    origin: dict[str, Path] = {}
    for path in sorted(Path(conf_dir).glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        train, evals = cfg.get("train_sources"), cfg.get("eval_sources")
        if train is None and evals is None:
            continue
        for key, specs in (("train_sources", train), ("eval_sources", evals)):
            if not isinstance(specs, list) or not specs:
                raise ValueError(
                    f"{path}: {key} must be a non-empty list of prompt source specs (see exittrain.data.source_spec), "
                    f"got {specs!r}; give both train_sources and eval_sources, or set both to null"
                )
        domain = str(cfg.get("domain") or path.stem)
        if domain in out:
            raise ValueError(
                f"{path}: domain {domain!r} is also defined by {origin[domain]}; give each data config its own domain"
            )
        out[domain], origin[domain] = DomainSources(train=tuple(train), eval=tuple(evals)), path
    if not out:
        raise ValueError(
            f"no data config in {conf_dir} lists train_sources and eval_sources; the domains' default prompt sources "
            "are read from there (conf/data/*.yaml of a checkout)"
        )
    return out


class _ConfiguredDomains(Mapping[str, DomainSources]):
    """``domain -> DomainSources`` of :data:`DATA_CONF_DIR`, read on first use, so that importing
    exittrain reads no config file and a caller that passes its own sources needs none."""

    @functools.cached_property
    def _table(self) -> dict[str, DomainSources]:
        return read_domain_sources(DATA_CONF_DIR)

    def __getitem__(self, domain: str) -> DomainSources:
        return self._table[domain]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"DOMAIN_SOURCES({self._table!r})"


DOMAIN_SOURCES: Mapping[str, DomainSources] = _ConfiguredDomains()
"""The default sources of each domain: the lists of the data configs (read on first use)."""

HUB_SOURCES: dict[str, DomainSources] = {
    "dialogue": DomainSources(
        train=("hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt",),
        eval=("hf:HuggingFaceH4/mt_bench_prompts:train:prompt.0",),
    ),
    "code": DomainSources(
        train=("hf:google-research-datasets/mbpp:full:train:text",),
        eval=("hf:openai/openai_humaneval:test:prompt",),
    ),
    "math": DomainSources(
        train=("hf:openai/gsm8k:main:train:question",),
        eval=("hf:openai/gsm8k:main:test:question", "hf:HuggingFaceH4/MATH-500:test:problem"),
    ),
}
"""Hub datasets for users with a network, read by the same loader: put them in a data config's lists
or on the command line (``data.train_sources='[hf:openai/gsm8k:main:train:question]'``)."""
