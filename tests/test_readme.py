"""The README's worked example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_register_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- example:register -->\n```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "ministral_example.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ministral: 21 tensors bit-identical on each of 2 ranks" in out.stdout


@pytest.mark.unit
def test_first_screen_register_example_registers_a_family():
    """The block as written, run in this process: it registers my_qwen2 with Qwen2's declarations."""
    import weightstream as ws
    from weightstream.converters.qwen2 import QWEN2
    from weightstream.converters.registry import unregister_converter

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- example:quick-register -->\n```python\n(.*?)```", text, re.S).group(1)
    assert "my_qwen2" not in ws.known_model_types()
    exec(compile(block, "<quick-register>", "exec"), {"__name__": "quick_register"})
    try:
        converter = ws.get_converter("my_qwen2")
        assert converter.model_type == "my_qwen2" and converter.mappings == QWEN2.mappings
    finally:
        unregister_converter("my_qwen2")
    assert "my_qwen2" not in ws.known_model_types()


def test_unknown_model_type_walk_through_runs_as_written(tmp_path):
    """The README's walk-through as written: its plugin saved as acme_converters.py, its commands run in that
    directory; the last of them (verify) passes only when every tensor is bit-identical."""
    text = (ROOT / "README.md").read_text()
    plugin = re.search(r"<!-- example:acme-plugin -->\n```python\n(.*?)```", text, re.S).group(1)
    commands = re.search(r"<!-- example:acme-convert -->\n```bash\n(.*?)```", text, re.S).group(1)
    (tmp_path / "acme_converters.py").write_text(plugin)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical: 47 tensors compared" in out.stdout
    assert "copied beside the shards: generation_config.json, tokenizer.json, tokenizer_config.json" in out.stdout
    import json

    assert json.loads((tmp_path / "acme-hf" / "config.json").read_text())["model_type"] == "acme"
