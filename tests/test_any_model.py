"""Any model registers: a config whose model_type transformers does not know (a directory, a dict, a config of any
class) is read as its fields, and converters come from plugins (--plugin, $WEIGHTSTREAM_PLUGINS, entry points)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from weightstream.common.hf_files import non_weight_files
from weightstream.converters.qwen3 import QWEN3
from weightstream.converters.registry import (
    PLUGINS_ENV,
    PluginError,
    load_plugins,
    model_spec,
    register_converter,
    unregister_converter,
)
from weightstream.models.presets import preset_config
from weightstream.models.spec import ConfigFields, hf_model_problem, load_hf_config

# A Qwen3-shaped config under a model_type transformers does not know, its code named for trust_remote_code.
FIELDS = {
    **{k: v for k, v in json.loads(preset_config("tiny-qwen3").to_json_string()).items()
       if k not in ("transformers_version", "dtype")},
    "model_type": "acme_unit", "architectures": ["AcmeForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig",
                 "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"},
}
RUNS_IF_IMPORTED = "raise RuntimeError('this code ran')\n"


@pytest.fixture
def acme():
    register_converter("acme_unit", QWEN3.derive("acme_unit"))
    yield
    unregister_converter("acme_unit")


def _acme_dir(path):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(FIELDS))
    (path / "configuration_acme.py").write_text(RUNS_IF_IMPORTED)
    (path / "modeling_acme.py").write_text(RUNS_IF_IMPORTED)
    return path


def _qwen3_spec():
    return dataclasses.replace(model_spec(preset_config("tiny-qwen3")), model_type="acme_unit")


@pytest.mark.unit
def test_a_directory_of_a_type_transformers_does_not_know_is_read_as_its_fields_without_running_its_code(
        tmp_path, acme):
    directory = _acme_dir(tmp_path / "acme")
    cfg = load_hf_config(directory)
    assert isinstance(cfg, ConfigFields) and dict(cfg.fields) == FIELDS
    assert model_spec(directory) == _qwen3_spec()
    assert model_spec(os.fspath(directory)) == _qwen3_spec()


@pytest.mark.unit
def test_a_dict_and_a_config_of_any_class_give_the_registered_spec(acme):
    from transformers import PretrainedConfig

    assert model_spec(dict(FIELDS)) == _qwen3_spec()
    acme_config = type("AcmeConfig", (PretrainedConfig,), {"model_type": "acme_unit"})
    values = {k: v for k, v in FIELDS.items() if k != "model_type"}
    assert model_spec(acme_config(**values)) == _qwen3_spec()


@pytest.mark.unit
def test_config_fields_travel_and_are_written_as_given(tmp_path):
    cfg = load_hf_config(dict(FIELDS))
    again = pickle.loads(pickle.dumps(cfg))
    assert dict(again.fields) == FIELDS and again.hidden_size == FIELDS["hidden_size"]
    cfg.with_fields(dtype="bfloat16").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {**FIELDS, "dtype": "bfloat16"}
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = cfg.nope


@pytest.mark.unit
def test_a_config_without_model_type_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config\.json has no model_type"):
        load_hf_config(tmp_path)


@pytest.mark.unit
def test_running_a_model_transformers_has_no_class_for_says_what_it_needs(tmp_path):
    problem = hf_model_problem(_acme_dir(tmp_path / "acme"))
    assert problem is not None and "'acme_unit'" in problem and "auto_map" in problem
    assert hf_model_problem(preset_config("tiny-qwen3")) is None


def test_the_engine_command_refuses_such_a_model_in_one_line(tmp_path, capsys):
    from weightstream.cli import main

    assert main(["engine", "--hf", os.fspath(_acme_dir(tmp_path / "acme"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no causal-LM model for model_type 'acme_unit'" in err[0]


@pytest.mark.unit
def test_non_weight_files_are_those_a_server_needs_beside_the_weights(tmp_path):
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "configuration_acme.py",
             "README.md"]
    weights = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pth", ".gitattributes"]
    for name in names + weights:
        (tmp_path / name).write_text("x")
    (tmp_path / "original").mkdir()
    (tmp_path / "linked.txt").symlink_to(tmp_path / "vocab.json")
    assert [p.name for p in non_weight_files(tmp_path)] == sorted([*names, "linked.txt"])


PLUGIN = """
import weightstream as ws
from weightstream.converters.qwen3 import QWEN3

ws.register_converter("{name}", QWEN3.derive("{name}"))
"""


@pytest.mark.unit
def test_load_plugins_imports_and_exports_them_and_lists_every_failure(tmp_path, monkeypatch):
    from weightstream.converters.registry import get_converter

    monkeypatch.setenv(PLUGINS_ENV, "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "acme_plugin_a.py").write_text(PLUGIN.format(name="acme_plugin_a"))
    try:
        assert load_plugins(["acme_plugin_a"], search=os.fspath(tmp_path)) == ["acme_plugin_a"]
        assert get_converter("acme_plugin_a").mappings == QWEN3.mappings
        assert os.environ[PLUGINS_ENV] == "acme_plugin_a"
    finally:
        unregister_converter("acme_plugin_a")
    (tmp_path / "acme_plugin_broken.py").write_text("raise ImportError('broken on purpose')\n")
    with pytest.raises(PluginError) as err:
        load_plugins(["acme_missing_one,acme_plugin_broken"])
    assert "acme_missing_one: ModuleNotFoundError" in str(err.value)
    assert "acme_plugin_broken: ImportError: broken on purpose" in str(err.value)


@pytest.mark.unit
def test_the_cli_loads_a_plugin_before_or_after_the_command(tmp_path, monkeypatch, capsys):
    from weightstream.cli import main

    monkeypatch.setenv(PLUGINS_ENV, "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme_cli_plugin.py").write_text(PLUGIN.format(name="acme_cli"))
    try:
        assert main(["families", "--plugin", "acme_cli_plugin"]) == 0
        assert any(line.startswith("acme_cli ") for line in capsys.readouterr().out.splitlines())
    finally:
        unregister_converter("acme_cli")
    assert main(["--plugin", "acme_cli_missing", "families"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cannot load plugin(s): acme_cli_missing: ModuleNotFoundError: No module named "
                   "'acme_cli_missing'"]


def test_entry_points_and_the_environment_bring_converters_to_any_process(tmp_path):
    """A distribution installed with a ``weightstream.converters`` entry point (a function) and a module named in
    $WEIGHTSTREAM_PLUGINS: a fresh process finds both converters on first use of the registry."""
    dist = tmp_path / "acme_dist-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-dist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[weightstream.converters]\nacme = acme_ep:register\n")
    (tmp_path / "acme_ep.py").write_text(textwrap.dedent("""
        def register():
            import weightstream as ws
            from weightstream.converters.qwen3 import QWEN3

            ws.register_converter("acme_ep", QWEN3.derive("acme_ep"))
    """))
    (tmp_path / "acme_env.py").write_text(PLUGIN.format(name="acme_env"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.fspath(tmp_path), os.environ.get("PYTHONPATH", "")]),
           PLUGINS_ENV: "acme_env"}
    code = ("import weightstream as ws; "
            "print(ws.get_converter('acme_ep').model_type, ws.get_converter('acme_env').model_type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["acme_ep", "acme_env"]
