"""The README's Python quick start runs as written (host backend)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_quick_start_runs(capsys):
    if not README.exists():
        pytest.skip("README.md not found next to the tests")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no ```python block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith(str(r)) for r, line in enumerate(lines))
