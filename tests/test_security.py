"""Security contracts: no pickles, no remote code, no evaluated strings, no secrets in run outputs.

- Drafters are written and read as safetensors only; a folder holding only a pickle is refused.
- Every ``torch.load`` in the package passes ``weights_only=True`` (AST scan), and a checkpoint that
  load refuses (it pickles a class or a call) gets our error, which never passes on torch's advice
  to retry with ``weights_only`` off (for a malicious file, that retry is the exploit).
- ``load_target`` runs no remote code unless ``trust_remote_code=True`` is asked for.
- The package never calls ``eval``/``exec`` or registers an OmegaConf resolver that does, and the
  repository's Hydra configs instantiate only exittrain and Lightning classes.
- API keys and tokens in the environment never reach the saved config, checkpoints, metrics or
  exported drafters.

Each AST scanner has a negative control: it must flag a synthetic source that breaks the rule.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf, open_dict

import exittrain
from exittrain import configs
from exittrain.lit import ExportDrafterCallback, MetricsFileCallback, save_drafter
from exittrain.lit.run_logging import close_logger, make_logger
from exittrain.models import load_drafter, load_target, new_drafter
from exittrain.settings import plan_stages
from tests.lit.helpers import loader, make_module
from tests.lit.helpers import trainer as make_trainer
from tests.models.helpers import tiny_target

PACKAGE = Path(exittrain.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}
SECRETS = {"WANDB_API_KEY": "secret-xyz", "HF_TOKEN": "hf_secretxyz"}

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


def test_the_scan_sees_the_whole_package():
    names = {p.relative_to(PACKAGE).as_posix() for p in SOURCES}
    expected = {
        "cli.py", "lit/module.py", "models/target_model.py", "data/prompts/prompt_sets.py", "core/tree.py",
        "safe_io.py",
    }
    assert expected <= names


# ----------------------------------------------------------------------------------------------
# safetensors only


def test_saved_drafter_is_safetensors_and_json_only(tmp_path, target):
    drafter = new_drafter(target, block_size=4, num_layers=1, seed=0)
    exported = save_drafter(drafter, tmp_path / "exported")
    drafter.save_pretrained(tmp_path / "pretrained")
    for folder in (exported, tmp_path / "pretrained"):
        files = {p.name for p in folder.rglob("*") if p.is_file()}
        assert files == {"config.json", "model.safetensors"}, files
        assert not {Path(f).suffix for f in files} & PICKLE_SUFFIXES
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        assert set(weights) == set(drafter.state_dict())  # the drafter's own weights, no target tensors


def test_loading_a_drafter_never_unpickles(tmp_path, target, monkeypatch):
    drafter = new_drafter(target, block_size=4, num_layers=1, seed=0)
    save_drafter(drafter, tmp_path / "good")

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load called while loading a safetensors drafter")

    monkeypatch.setattr(torch, "load", no_torch_load)
    loaded = load_drafter(tmp_path / "good", target)
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in loaded.state_dict().items())

    # a folder with a pickled checkpoint only is refused before anything is read
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError) as err:
        load_drafter(pickled, target)
    message = str(err.value)
    assert str(pickled) in message and "pytorch_model.bin" in message and "safetensors only" in message
    assert "save_drafter" in message


# ----------------------------------------------------------------------------------------------
# torch.load(weights_only=True)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_torch_loads(source: str) -> list[int]:
    """Lines of ``torch.load``/``torch.serialization.load`` calls without a literal ``weights_only=True``,
    and of imports that would hide such a call (``from torch import load``)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            bad += [node.lineno for alias in node.names if alias.name == "load"]
        if isinstance(node, ast.Call) and _dotted(node.func) in ("torch.load", "torch.serialization.load"):
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                bad.append(node.lineno)
    return bad


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("import torch\nx = torch.load('model.pt')\n", [2]),
        ("import torch\nx = torch.load(p, map_location='cpu', weights_only=False)\n", [2]),
        ("import torch\nx = torch.load(p, **options)\n", [2]),  # weights_only hidden in **options
        ("import torch\nx = torch.serialization.load(p)\n", [2]),
        ("from torch import load\nx = load(p)\n", [1]),
        ("import torch\nx = torch.load(p, map_location='cpu', weights_only=True)\n", []),
        ("import json\nx = json.load(f)\n", []),
    ],
)
def test_torch_load_scanner_negative_controls(source, flagged):
    assert unsafe_torch_loads(source) == flagged


def test_every_torch_load_in_the_package_uses_weights_only():
    bad = {p.relative_to(PACKAGE).as_posix(): lines for p in SOURCES if (lines := unsafe_torch_loads(p.read_text()))}
    assert not bad, f"torch.load without weights_only=True (unpickles arbitrary objects): {bad}"


class Smuggled:
    """A class that no safe load allows: a checkpoint pickling it is refused, whatever the class does."""


class RunsOnLoad:
    """Pickles as a call of ``print`` (a harmless stand-in for ``os.system``): unpickling it runs the call."""

    def __reduce__(self):
        return (print, ("EXPLOIT RAN",))


REFUSED_FIX = "Do not load it with an unsafe loader (unpickling it can run arbitrary code)"


def assert_refused_in_our_words(err: pytest.ExceptionInfo, path: Path, asked: str) -> None:
    """The message names the file, the refused name and the fix; torch's text (with its advice to
    retry unsafely) is neither in the message nor in the printed traceback."""
    import traceback

    message = str(err.value)
    assert str(path) in message and f"holds objects that a safe load refuses (it asks for {asked})" in message
    assert REFUSED_FIX in message and "weights_only" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # raised from None
    printed = "".join(traceback.format_exception(err.value))
    assert "Weights only load failed" not in printed and "weights_only=False" not in printed


def test_torch_own_refusal_advises_the_unsafe_retry(tmp_path):
    """The control: what the tests below keep out of our messages is really in torch's."""
    import pickle

    path = tmp_path / "smuggled.ckpt"
    torch.save({"x": Smuggled()}, path)
    with pytest.raises(pickle.UnpicklingError) as err:
        torch.load(path, map_location="cpu", weights_only=True)
    assert "Weights only load failed" in str(err.value) and "`weights_only` set to `False`" in str(err.value)


def test_ckpt_path_pickling_a_class_is_refused_in_our_words(tmp_path):
    path = tmp_path / "smuggled.ckpt"
    torch.save({"hyper_parameters": {"stage": "exittrain"}, "state_dict": {}, "x": Smuggled()}, path)
    configs.register_recipes()
    with initialize_config_dir(config_dir=str(configs.CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=["+recipe=code", f"ckpt_path={path}", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ValueError) as err:
        plan_stages(cfg)
    assert_refused_in_our_words(err, path, "tests.test_security.Smuggled")
    assert str(err.value).startswith(f"ckpt_path checkpoint {path} holds objects")
    assert "point ckpt_path at another checkpoint written by exittrain" in str(err.value)


def test_checkpoint_pickling_a_call_is_refused_and_never_runs(tmp_path, capsys, target):
    """A raw (non-zip, protocol 2) pickle whose load would call a function: refused before the call."""
    import pickle

    from exittrain.lit import ExitTrainModule

    path = tmp_path / "runs_on_load.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": {}, "x": RunsOnLoad()}, protocol=2))
    with pytest.raises(ValueError) as err:
        ExitTrainModule.drafter_from_checkpoint(path, target)
    assert_refused_in_our_words(err, path, "print")
    assert "pass another checkpoint written by exittrain" in str(err.value)
    assert "EXPLOIT RAN" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# no remote code unless asked


def test_load_target_defaults_to_no_remote_code():
    import inspect

    assert inspect.signature(load_target).parameters["trust_remote_code"].default is False
    for path in sorted((configs.CONF_DIR / "target").glob("*.yaml")):
        assert yaml.safe_load(path.read_text())["trust_remote_code"] is False, path


@pytest.mark.parametrize("asked", [None, True])
def test_load_target_passes_trust_remote_code_to_every_loader(monkeypatch, asked):
    """Offline: the hub loaders (config, model, tokenizer) are replaced by fakes that record their keyword arguments."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    calls = {}

    def fake_config(path, **kwargs):
        calls["config"] = (path, kwargs)
        return tiny_target("llama").model.config

    def fake_model(path, **kwargs):
        calls["model"] = (path, kwargs)
        return tiny_target("llama").model

    def fake_tokenizer(path, **kwargs):
        calls["tokenizer"] = (path, kwargs)
        return None

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tokenizer)
    monkeypatch.setattr(AutoConfig, "from_pretrained", fake_config)
    extra = {} if asked is None else {"trust_remote_code": asked}
    target = load_target("org/some-model", **extra)
    want = bool(asked)
    assert target.name == "org/some-model"
    assert calls["config"][0] == calls["model"][0] == calls["tokenizer"][0] == "org/some-model"
    assert all(calls[loader][1]["trust_remote_code"] is want for loader in ("config", "model", "tokenizer"))


def literal_remote_code(source: str) -> list[int]:
    """Lines passing ``trust_remote_code=True`` as a literal."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is True
    ]


def test_no_literal_trust_remote_code_true_in_the_package():
    assert literal_remote_code("from_pretrained(p, trust_remote_code=True)\n") == [1]  # negative control
    assert literal_remote_code("from_pretrained(p, trust_remote_code=trust_remote_code)\n") == []
    bad = {p.relative_to(PACKAGE).as_posix(): lines for p in SOURCES if (lines := literal_remote_code(p.read_text()))}
    assert not bad, f"remote code enabled unconditionally: {bad}"


# ----------------------------------------------------------------------------------------------
# config strings are never evaluated as code

EVALUATORS = {"eval", "exec", "builtins.eval", "builtins.exec"}


def code_evaluations(source: str) -> list[int]:
    """Lines calling ``eval``/``exec`` (not a ``.eval()`` method such as ``model.eval()``), or registering
    an OmegaConf resolver whose arguments mention them."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in EVALUATORS:
            bad.append(node.lineno)
        elif name.rsplit(".", 1)[-1] in ("register_new_resolver", "register_resolver"):
            mentioned = {_dotted(n) for arg in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(arg)}
            if mentioned & EVALUATORS:
                bad.append(node.lineno)
    return sorted(set(bad))


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("x = eval(cfg.expr)\n", [1]),
        ("exec(text)\n", [1]),
        ("import builtins\nbuiltins.eval(s)\n", [2]),
        ("from omegaconf import OmegaConf\nOmegaConf.register_new_resolver('eval', eval)\n", [2]),
        ("OmegaConf.register_new_resolver('py', lambda s: eval(s))\n", [1]),
        ("model.eval()\ndrafter.eval()\n", []),
        ("OmegaConf.register_new_resolver('double', lambda x: 2 * x)\n", []),
    ],
)
def test_evaluation_scanner_negative_controls(source, flagged):
    assert code_evaluations(source) == flagged


def test_the_package_never_evaluates_strings_as_code():
    bad = {p.relative_to(PACKAGE).as_posix(): lines for p in SOURCES if (lines := code_evaluations(p.read_text()))}
    assert not bad, f"eval/exec (or a resolver using them) in the package: {bad}"


def _targets(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["_target_"]] if "_target_" in node else []
        return own + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


ALLOWED_TARGETS = ("exittrain.", "lightning.")


def test_repository_configs_instantiate_only_exittrain_and_lightning():
    files = sorted(configs.CONF_DIR.rglob("*.yaml")) + sorted(configs.RECIPES_DIR.glob("*.yaml"))
    found = {str(p.relative_to(configs.CONF_DIR.parent)): _targets(yaml.safe_load(p.read_text())) for p in files}
    targets = [t for ts in found.values() for t in ts]
    assert "exittrain.lit.ExitTrainModule" in targets and "exittrain.models.load_target" in targets
    bad = {f: outside for f, ts in found.items() if (outside := [t for t in ts if not t.startswith(ALLOWED_TARGETS)])}
    assert not bad, f"a config instantiates something outside {ALLOWED_TARGETS}: {bad}"


# ----------------------------------------------------------------------------------------------
# secrets never written


def files_containing(root: Path, secrets) -> dict[str, list[str]]:
    """Files under ``root`` whose bytes contain any of ``secrets`` (checkpoints are uncompressed zips)."""
    hits = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            found = [s for s in secrets if s.encode() in data]
            if found:
                hits[str(path.relative_to(root))] = found
    return hits


def test_secret_scanner_negative_control(tmp_path):
    (tmp_path / "clean.json").write_text('{"a": 1}')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "leak.yaml").write_text("token: hf_secretxyz\n")
    assert files_containing(tmp_path, SECRETS.values()) == {"sub/leak.yaml": ["hf_secretxyz"]}


@contextlib.contextmanager
def composed_fit_config(monkeypatch, tmp_path):
    """The `fit +recipe=code` config with the secrets in the environment and Hydra's runtime set
    (``${hydra:runtime.cwd}`` resolves as in a run); yields ``(cfg without hydra, hydra yaml)``."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))  # the one env value the config reads
    configs.register_recipes()
    with initialize_config_dir(config_dir=str(configs.CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=["+recipe=code", f"paths.output_dir={tmp_path}"], return_hydra_config=True)
    hydra_yaml = OmegaConf.to_yaml(cfg.hydra)  # Hydra saves it apart, as .hydra/hydra.yaml
    HydraConfig.instance().set_config(cfg)
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        yield cfg, hydra_yaml
    finally:
        HydraConfig.instance().cfg = None


def test_composed_fit_config_holds_no_environment_secrets(monkeypatch, tmp_path):
    """What Hydra saves (.hydra/config.yaml, hydra.yaml) and what W&B gets (the resolved config)."""
    with composed_fit_config(monkeypatch, tmp_path) as (cfg, hydra_yaml):
        saved = OmegaConf.to_yaml(cfg) + hydra_yaml
        resolved = yaml.safe_dump(OmegaConf.to_container(cfg, resolve=True))
    assert str(tmp_path / "cache") in resolved  # the resolution did read the environment
    for secret in SECRETS.values():
        assert secret not in saved and secret not in resolved


def test_wandb_offline_run_files_hold_no_environment_secrets(monkeypatch, tmp_path, target):
    """The default logger (W&B, offline) as `fit` builds it, through a tiny training run and
    ``wandb.finish()``: no file of the offline run (config, metadata, history, the binary
    ``.wandb`` log) contains the API key or the hub token."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with composed_fit_config(monkeypatch, tmp_path) as (cfg, _):
        logger = make_logger(cfg, "secrets-check")
        try:
            make_trainer(2, logger=logger).fit(make_module(target, stage="pretrain"), loader(4))
        finally:
            close_logger(logger)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" for p in runs[0].iterdir()), runs
    assert files_containing(tmp_path / "wandb", ["exittrain"]), "the scan must see the run's own config"
    assert files_containing(tmp_path, SECRETS.values()) == {}


def test_fit_outputs_hold_no_environment_secrets(monkeypatch, tmp_path, target):
    """A tiny fit writing everything a run writes: checkpoint (hyper_parameters), logger hparams and
    metrics, metrics JSON, exported drafter; none of it contains an environment secret."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    module = make_module(target, stage="exittrain")
    callbacks = [
        ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True),
        ExportDrafterCallback(tmp_path, name="drafter"),
        MetricsFileCallback(tmp_path, "exittrain"),
    ]
    trainer = make_trainer(2, callbacks=callbacks, logger=CSVLogger(tmp_path / "logs"), checkpointing=True)
    trainer.fit(module, loader(4))

    written = {p.suffix for p in tmp_path.rglob("*") if p.is_file()}
    assert {".ckpt", ".json", ".safetensors", ".yaml", ".csv"} <= written, written
    assert files_containing(tmp_path, SECRETS.values()) == {}
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    text = repr({k: v for k, v in ckpt.items() if k != "state_dict"})
    assert "hyper_parameters" in ckpt and all(secret not in text for secret in SECRETS.values())
