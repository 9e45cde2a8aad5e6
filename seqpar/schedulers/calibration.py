"""Calibration files of ``seqpar calibrate``: a measured machine (:class:`ClusterSpec`) and cost model.

``{"format": "seqpar-calibration", "version": 1, "cluster": {...}, "cost_model": {...},
"measurements": {...}, "machine": {...}, "versions": {...}, "command": "..."}``. Written by
``seqpar calibrate`` (:mod:`seqpar.bench.calibrate`), read by the planner (``seqpar plan``,
``seqpar train --adaptive --calibration FILE``) and the simulator. :func:`rescale_cost_model` moves
a calibrated model to another attention shape.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

from .._version import __version__
from .cluster import ClusterSpec, check_file_keys
from .cost import CostModel

FORMAT = "seqpar-calibration"


#: the keys save_calibration writes (read back: cluster and cost_model; the rest is a record)
_KEYS = frozenset({"format", "version", "cluster", "cost_model", "measurements", "machine", "versions", "command"})


def save_calibration(path: str | Path, cluster: ClusterSpec, cost_model: CostModel, *,
                     measurements: dict | None = None, command: str | None = None) -> None:
    """Write a calibration file (see the module docstring for the layout)."""
    import torch

    data = {"format": FORMAT, "version": 1, "cluster": cluster.to_dict(), "cost_model": cost_model.to_dict(),
            "measurements": measurements or {},
            "machine": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count(), "platform": platform.platform(),
                        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "seqpar": __version__},
            "command": command if command is not None else " ".join(["seqpar"] + sys.argv[1:])}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_calibration(path: str | Path) -> tuple[ClusterSpec, CostModel]:
    """Read a ``seqpar calibrate`` file: (ClusterSpec, CostModel). ValueError naming the file and field."""
    source = f"calibration file {str(path)!r}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{source}: cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc}); write one with 'seqpar calibrate --out PATH'") from None
    if not isinstance(data, dict) or "cluster" not in data or "cost_model" not in data:
        raise ValueError(f"{source}: expected an object with 'cluster' and 'cost_model' (the output of "
                         f"'seqpar calibrate'); a bare cost model loads with CostModel.load")
    check_file_keys(data, _KEYS, source)
    cluster = ClusterSpec.from_dict(data["cluster"], source=f"{source}: cluster")
    cost = CostModel.from_dict(data["cost_model"], source=f"{source}: cost_model")
    return cluster, cost


def rescale_cost_model(cost: CostModel, heads: int, kv_heads: int, head_dim: int, layers: int) -> CostModel:
    """A calibrated model moved to another attention shape: α1, α2, β1 and per-token memory scale with
    hidden·layers (attention work per token pair and per token is proportional to Hq·D per layer)."""
    h = heads * head_dim
    f = h * layers / (cost.hidden * cost.layers)
    fl = layers / cost.layers
    methods = tuple((n, replace(c, alpha1=c.alpha1 * f, alpha2=c.alpha2 * f, beta1=c.beta1 * fl,
                                m_token=c.m_token * f, m_token_full=c.m_token_full * f))
                    for n, c in cost.methods)
    return CostModel(methods=methods, hidden=h, kv_hidden=kv_heads * head_dim, layers=layers, n_heads=heads,
                     bytes_per_element=cost.bytes_per_element, grad_bytes_per_element=cost.grad_bytes_per_element)


__all__ = ["FORMAT", "load_calibration", "rescale_cost_model", "save_calibration"]
