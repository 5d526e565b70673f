"""`epx eplb simulate --plot` draws through epx.plot (runs where the CLI was built beside the package)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")


def find_cli():
    for candidate in (os.environ.get("EPX_CLI"), "./epx", shutil.which("epx")):
        if candidate and pathlib.Path(candidate).is_file():
            return str(pathlib.Path(candidate).resolve())
    pytest.skip("epx CLI not found (set EPX_CLI)")


def test_simulate_plot_writes_a_png(tmp_path):
    png = tmp_path / "sim.png"
    env = dict(os.environ, EPX_PYTHON=sys.executable)
    done = subprocess.run([find_cli(), "eplb", "simulate", "--steps", "120", "--layers", "2", "--report-every", "20",
                           "--plot", str(png)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "sim.png.json").exists()  # the temporary JSON is removed
