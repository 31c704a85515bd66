"""``npugraph bench --plot PATH``: the modeled steps/s as one chart, drawn from the JSON document
``npugraph bench`` returns (``--json`` writes it), so a committed run can be drawn again
(``--from-json FILE``).

Top: each modeled shape's steps/s per implementation, a bar at the median over the seeds with
the min-max as error bars where the document has them (``steps_per_s_spread``, recorded since
2026-12-06), the API floor and the device limit as reference lines.  Bottom: the tiling-sink
rows' steps/s against the layer count.

matplotlib is npugraph's ``plot`` extra: imported here, when a chart is drawn, never by
``import npugraph``.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from npugraph.errors import NpuGraphError
from npugraph.files import write_bytes

__all__ = ["FIGSIZE", "DPI", "require_matplotlib", "plot_bench"]

FIGSIZE, DPI = (14.0, 10.0), 100  # the PNG: 1400 x 1000 pixels
SHAPES = ("host_bound", "small_batch", "device_bound")
# the bars, in order: (key in steps_per_s, label); a key the document lacks is left out
BARS = (
    ("npugraph_default", "npugraph default\n(Runtime())"),
    ("npugraph_update_free", "npugraph\nupdate-free"),
    ("npugraph", "npugraph\nper layer"),
    ("npugraph_grouped", "npugraph\nevents grouped"),
    ("updatable_mrv2", "UpdatableGraph\n(MRV2)"),
    ("updatable_mrv1", "UpdatableGraph\n(MRV1)"),
    ("legacy", "older\nloop"),
    ("torch_npu_update", "torch_npu\nNPUGraph.update"),
)
COLORS = {
    "npugraph_default": "#c62828",
    "npugraph_update_free": "#ff8f00",
    "npugraph": "#ef9a9a",
    "npugraph_grouped": "#e57373",
    "updatable_mrv2": "#1565c0",
    "updatable_mrv1": "#90caf9",
    "legacy": "#9e9e9e",
    "torch_npu_update": "#2e7d32",
}


def require_matplotlib() -> None:
    """Refuse, before any work, a chart where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise NpuGraphError(f"--plot needs matplotlib ({exc}); install it with pip install 'npugraph[plot]'") from exc


def _modeled(doc: Any, what: str) -> dict[str, Any]:
    modeled = doc.get("summary", {}).get("modeled") if isinstance(doc, dict) else None
    if not isinstance(modeled, dict) or not all(
        isinstance(modeled.get(s), dict) and isinstance(modeled[s].get("steps_per_s"), dict) for s in SHAPES
    ):
        raise NpuGraphError(
            f"{what}: no modeled rows (summary.modeled.{{{','.join(SHAPES)}}}.steps_per_s): "
            "not a document npugraph bench --json wrote"
        )
    return modeled


def plot_bench(doc: dict[str, Any], path: str, *, what: str = "the bench result") -> None:
    """Draw ``doc`` (the document ``npugraph bench --json`` writes) into the PNG ``path``;
    ``what`` names the document in an error."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modeled = _modeled(doc, what)
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg: no display
    grid = fig.add_gridspec(2, len(SHAPES), height_ratios=[1.25, 1.0])
    spread_missing = False
    for i, label in enumerate(SHAPES):
        spread_missing |= _shape_panel(fig.add_subplot(grid[0, i]), label, modeled[label])
    _sink_panel(fig.add_subplot(grid[1, : len(SHAPES) - 1]), modeled.get("tiling_sink"))
    _sweep_panel(fig.add_subplot(grid[1, len(SHAPES) - 1]), modeled.get("update_free_sweep"))
    seeds = modeled.get("seeds", "?")
    costs = modeled.get("host_costs", "?")
    bars = f"bars: the median of {seeds} seeds" + (
        " (this document has no per-seed spread: no error bars)" if spread_missing else ", error bars min-max"
    )
    fig.suptitle(
        f"npugraph bench, modeled on the device timeline: steps/s, higher is better; {bars}\n"
        f"host costs: {costs if isinstance(costs, str) else 'from a calibration file'}",
        fontsize=11,
    )
    out = io.BytesIO()
    fig.savefig(out, format="png")
    write_bytes(path, out.getvalue())


def _shape_panel(ax: Any, label: str, row: dict[str, Any]) -> bool:
    """One shape's bars and reference lines; True where the row has no per-seed spread."""
    sps, spread = row["steps_per_s"], row.get("steps_per_s_spread")
    keys = [(k, name) for k, name in BARS if k in sps]
    xs = range(len(keys))
    heights = [float(sps[k]) for k, _ in keys]
    yerr = None
    if isinstance(spread, dict) and all(k in spread for k, _ in keys):
        # the spread's own median (steps_per_s is rounded to 0.1, the spread is not)
        heights = [float(spread[k]["median"]) for k, _ in keys]
        yerr = [
            [h - float(spread[k]["min"]) for h, (k, _) in zip(heights, keys)],
            [float(spread[k]["max"]) - h for h, (k, _) in zip(heights, keys)],
        ]
    bars = ax.bar(xs, heights, yerr=yerr, capsize=4, color=[COLORS[k] for k, _ in keys], edgecolor="black", lw=0.5)
    ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax.set_xticks(list(xs), [name for _, name in keys], rotation=60, ha="right", rotation_mode="anchor", fontsize=8)
    if "api_floor" in sps:
        ax.axhline(
            sps["api_floor"],
            color="black",
            ls="--",
            lw=1,
            label=f"API floor (per-layer calls, no Python): {sps['api_floor']:.0f}",
        )
    if "device_limit_steps_per_s" in row:
        limit = row["device_limit_steps_per_s"]
        ax.axhline(limit, color="#6a1b9a", ls=":", lw=1.5, label=f"device limit (device work alone): {limit:.0f}")
    top = max([*heights, float(sps.get("api_floor", 0)), float(row.get("device_limit_steps_per_s", 0))])
    ax.set_ylim(0, top * 1.3)  # room for the legend above the reference lines
    ax.set_ylabel("steps/s (modeled)")
    kernel = str(row.get("kernel", "?")).upper()
    ax.set_title(
        f"{label}: {row.get('layers', '?')} layers, batch {row.get('size', '?')}, {kernel}\n"
        f"{row.get('attention_us', 0) + row.get('other_us', 0):g} us of device work a layer",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return yerr is None


def _sink_panel(ax: Any, sink: Any) -> None:
    """The tiling-sink rows: steps/s against layers, one line per implementation, the sink's
    per metadata-op device time."""
    if not isinstance(sink, dict) or not sink.get("rows"):
        ax.axis("off")
        ax.text(0.5, 0.5, "tiling sink: no rows in this document (recorded since 2026-12-01)", ha="center")
        return
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("steps/s (modeled)")
    ax.grid(alpha=0.3)
    rows = sorted(sink["rows"], key=lambda r: r["layers"])
    layers = [r["layers"] for r in rows]
    # UpdatableGraph and the per-layer update do not run the metadata op: one line each
    for key, name in (("updatable_mrv2", "UpdatableGraph (MRV2)"), ("npugraph_grouped", "npugraph events grouped")):
        ys = [statistics.median(m["steps_per_s"][key] for m in r["by_metadata_us"]) for r in rows]
        ax.plot(layers, ys, marker="o", color=COLORS[key], label=name)
    metadata = [m["metadata_us"] for m in rows[0]["by_metadata_us"]]
    for j, m_us in enumerate(metadata):
        ys = [r["by_metadata_us"][j]["steps_per_s"]["npugraph_sink"] for r in rows]
        ax.plot(
            layers,
            ys,
            marker="s",
            color=COLORS["npugraph_default"],
            alpha=1.0 - 0.25 * j,
            ls=("-", "--", ":")[j % 3],
            label=f"npugraph tiling sink, metadata op {m_us:g} us",
        )
    ax.set_xticks(layers)
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"tiling sink (FIA's lengths on the device), host-bound FIA at batch {sink.get('size', '?')}, "
        f"{sink.get('attention_us', 0) + sink.get('other_us', 0):g} us of device work a layer",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right")


def _sweep_panel(ax: Any, sweep: Any) -> None:
    """The update-free sweep: update-free over updated per layer against the longest context,
    a line per batch; above 1 the update-free graph is faster, the crossing is the crossover."""
    if not isinstance(sweep, dict) or not sweep.get("rows"):
        ax.axis("off")
        ax.text(0.5, 0.5, "update-free sweep: not in this document (recorded since 2026-12-08)", ha="center")
        return
    for j, row in enumerate(sweep["rows"]):
        xs = [p["context"] for p in row["points"]]
        ys = [p["update_free_vs_updated"] for p in row["points"]]
        ax.plot(xs, ys, marker="o", color=f"C{j}", label=f"batch {row['batch']} ({row['updated_kernel']})")
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("longest request's context (keys)")
    ax.set_ylabel("update-free / updated per layer (steps/s)")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"update-free / updated, {sweep.get('layers', '?')} layers\n(the per-step choice: "
        f"{sweep.get('choice_vs_better_min', float('nan')):.3f} of the better)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right")
