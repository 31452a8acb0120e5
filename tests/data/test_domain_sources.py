"""The domains' default prompt sources are the lists of the data configs: one copy, and checked."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from exittrain.data.domain_sources import DATA_CONF_DIR, DOMAIN_SOURCES, DomainSources, read_domain_sources
from exittrain.data.source_spec import PromptSource


def test_every_shipped_data_config_shows_what_it_trains_on():
    files = sorted(DATA_CONF_DIR.glob("*.yaml"))
    assert {f.stem for f in files} == {"code", "dialogue", "math"}
    for path in files:
        cfg = OmegaConf.load(path)
        assert cfg.train_sources and cfg.eval_sources, f"{path.name} lists no sources"
        assert DOMAIN_SOURCES[cfg.domain] == DomainSources(tuple(cfg.train_sources), tuple(cfg.eval_sources))
        for spec in [*cfg.train_sources, *cfg.eval_sources]:
            assert PromptSource.parse(spec).kind == "pkg"  # the defaults work offline


def _write(folder, name, text):
    (folder / f"{name}.yaml").write_text(text)


def test_configs_without_lists_name_no_domain_and_the_domain_key_wins(tmp_path):
    _write(tmp_path, "a", "domain: alpha\ntrain_sources: [pkg:codeio]\neval_sources: [pkg:humaneval]\n")
    _write(tmp_path, "b", "train_sources: ['jsonl:t.jsonl:p']\neval_sources: ['jsonl:e.jsonl:p']\n")
    _write(tmp_path, "c", "domain: gamma\ntrain_sources: null\neval_sources: null\n")
    assert read_domain_sources(tmp_path) == {
        "alpha": DomainSources(("pkg:codeio",), ("pkg:humaneval",)),
        "b": DomainSources(("jsonl:t.jsonl:p",), ("jsonl:e.jsonl:p",)),
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("train_sources: [pkg:codeio]\neval_sources: null\n", r"x\.yaml: eval_sources must be a non-empty list"),
        ("train_sources: []\neval_sources: [pkg:humaneval]\n", r"x\.yaml: train_sources must be a non-empty list"),
        ("train_sources: pkg:codeio\neval_sources: [pkg:humaneval]\n", "got 'pkg:codeio'"),
    ],
)
def test_half_given_or_malformed_lists_name_the_file(tmp_path, text, message):
    _write(tmp_path, "x", text)
    with pytest.raises(ValueError, match=message):
        read_domain_sources(tmp_path)


def test_a_domain_defined_twice_and_a_folder_without_lists_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no data config in .* lists train_sources"):
        read_domain_sources(tmp_path)
    lists = "train_sources: [pkg:codeio]\neval_sources: [pkg:humaneval]\n"
    _write(tmp_path, "one", "domain: code\n" + lists)
    _write(tmp_path, "two", "domain: code\n" + lists)
    with pytest.raises(ValueError, match=r"two\.yaml: domain 'code' is also defined by .*one\.yaml"):
        read_domain_sources(tmp_path)


def test_given_sources_read_no_data_config_and_defaults_name_the_missing_folder(tmp_path, monkeypatch):
    from exittrain.data import domain_sources, sources

    monkeypatch.setattr(domain_sources, "DATA_CONF_DIR", tmp_path)  # holds no data config
    monkeypatch.setattr(sources, "DOMAIN_SOURCES", domain_sources._ConfiguredDomains())  # not read yet
    (tmp_path / "t.jsonl").write_text('{"p": "train on me"}\n')
    (tmp_path / "e.jsonl").write_text('{"p": "evaluate me"}\n')
    got = sources.load_domain(
        "custom", train=[f"jsonl:{tmp_path / 't.jsonl'}:p"], eval=[f"jsonl:{tmp_path / 'e.jsonl'}:p"]
    )
    assert (got.domain, got.train, got.eval) == ("custom", ["train on me"], ["evaluate me"])
    with pytest.raises(ValueError, match=f"no data config in {re.escape(str(tmp_path))} lists train_sources"):
        sources.load_domain("code")
