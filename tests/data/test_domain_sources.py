"""The domains' default prompt sources: plain Python values in the data layer, equal to the lists of
the data configs (conf/data/*.yaml), which a run reads."""

from __future__ import annotations

from omegaconf import OmegaConf

from exittrain.configs import CONF_DIR
from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES, DomainSources
from exittrain.data.prompts.prompt_sets import load_domain
from exittrain.data.prompts.source_spec import PromptSource


def test_every_data_config_lists_the_sources_of_its_domain():
    files = sorted((CONF_DIR / "data").glob("*.yaml"))
    assert {f.stem for f in files} == {"code", "dialogue", "math"} == set(DOMAIN_SOURCES)
    for path in files:
        cfg = OmegaConf.load(path)
        assert cfg.train_sources and cfg.eval_sources, f"{path.name} lists no sources"
        assert DOMAIN_SOURCES[cfg.domain] == DomainSources(tuple(cfg.train_sources), tuple(cfg.eval_sources)), (
            f"{path} and exittrain.data.prompts.domain_sources.DOMAIN_SOURCES[{cfg.domain!r}] list other sources; "
            "change both"
        )
        for spec in [*cfg.train_sources, *cfg.eval_sources]:
            assert PromptSource.parse(spec).kind == "pkg"  # the defaults work offline


def test_given_sources_need_no_default_domain(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"p": "train on me"}\n')
    (tmp_path / "e.jsonl").write_text('{"p": "evaluate me"}\n')
    got = load_domain("custom", train=[f"jsonl:{tmp_path / 't.jsonl'}:p"], eval=[f"jsonl:{tmp_path / 'e.jsonl'}:p"])
    assert (got.domain, got.train, got.eval) == ("custom", ["train on me"], ["evaluate me"])
