"""epx.plot: charts of EPLB results (optional: needs matplotlib, imported on first use).

* ``utilization_over_time(result)``: utilization over the simulated steps, with and without EPLB;
* ``gpu_load_before_after(before, after)``: per-GPU load bars of two placements;
* ``simulation_report(result, path)``: both in one figure, saved to ``path``.

``result`` is an ``epx.eplb.SimulationResult`` or the JSON object ``epx eplb simulate`` prints (a dict).
Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no display needed).

From the command line: ``epx eplb simulate ... | python -m epx.plot - out.png``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("epx.plot needs matplotlib (pip install matplotlib)") from e
    return Figure


def _timeline(result: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    if isinstance(result, dict):
        rows = result["timeline"]
        return (np.array([r["step"] for r in rows]), np.array([r["utilization_rebalanced"] for r in rows]),
                np.array([r["utilization_static"] for r in rows]), int(result.get("utilization_window_steps", 10)))
    return result.steps, result.utilization_rebalanced, result.utilization_static, result.utilization_window_steps


def _gpu_loads(result: Any) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    if isinstance(result, dict):
        if "gpu_load_static" not in result:
            return None
        return np.asarray(result["gpu_load_static"]), np.asarray(result["gpu_load_rebalanced"])
    return result.gpu_load_static, result.gpu_load_rebalanced


def _new_axes(ax):
    if ax is not None:
        return ax.figure, ax
    fig = _matplotlib()(figsize=(8, 4), layout="constrained")
    return fig, fig.subplots()


def utilization_over_time(result: Any, ax: Any = None, path: Optional[str] = None):
    """Line chart of utilization (mean / max GPU load over the recorder window) per reported step.

    Draws into ``ax`` when given, else a new figure; saves to ``path`` when given. Returns the figure.
    """
    steps, rebalanced, static, window = _timeline(result)
    fig, ax = _new_axes(ax)
    ax.plot(steps, static, label="static placement", color="tab:gray")
    ax.plot(steps, rebalanced, label="EPLB", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel(f"utilization (last {window} steps)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("EPLB utilization over time")
    if path:
        fig.savefig(path)
    return fig


def gpu_load_before_after(before: Sequence[float], after: Sequence[float], ax: Any = None,
                          path: Optional[str] = None, labels: Tuple[str, str] = ("before", "after")):
    """Grouped bars of each GPU's load under two placements (e.g. ``epx.eplb.gpu_loads(...).sum(0)``).

    A dashed line marks the mean (equal for both: replicas split load exactly). Returns the figure.
    """
    before, after = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if before.shape != after.shape or before.ndim != 1:
        raise ValueError(f"before {before.shape} and after {after.shape}: expected two [num_gpus] arrays")
    fig, ax = _new_axes(ax)
    x = np.arange(before.size)
    ax.bar(x - 0.2, before, width=0.4, label=f"{labels[0]} (max/mean {before.max() / max(before.mean(), 1e-12):.2f})",
           color="tab:gray")
    ax.bar(x + 0.2, after, width=0.4, label=f"{labels[1]} (max/mean {after.max() / max(after.mean(), 1e-12):.2f})",
           color="tab:blue")
    ax.axhline(before.mean(), color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("GPU")
    ax.set_ylabel("load (tokens)")
    ax.set_title("per-GPU load")
    ax.legend(loc="upper right")
    if path:
        fig.savefig(path)
    return fig


def simulation_report(result: Any, path: Optional[str] = None):
    """Utilization over time and, when the result has them, before/after per-GPU loads, in one figure."""
    loads = _gpu_loads(result)
    fig = _matplotlib()(figsize=(8, 7 if loads else 4), layout="constrained")
    axes = fig.subplots(2 if loads else 1, 1, squeeze=False)[:, 0]
    utilization_over_time(result, ax=axes[0])
    if loads:
        gpu_load_before_after(loads[0], loads[1], ax=axes[1], labels=("static", "EPLB"))
    if path:
        fig.savefig(path)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m epx.plot RESULT.json|- OUT.png``: charts of an ``epx eplb simulate`` result."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m epx.plot RESULT.json|- OUT.png", file=sys.stderr)
        return 2
    text = sys.stdin.read() if args[0] == "-" else open(args[0]).read()
    simulation_report(json.loads(text), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
