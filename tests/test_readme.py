"""The README's worked example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_register_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- example:register -->\n```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "llama_example.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "llama: 21 tensors bit-identical on each of 2 ranks" in out.stdout
