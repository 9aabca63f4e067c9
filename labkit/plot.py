"""A few consistent charts: breakdown, timeline, trade-off, scaling. Each returns its matplotlib Axes."""
from __future__ import annotations

from .memory import CATEGORIES
from .units import GiB, MiB

__all__ = ["breakdown", "timeline", "tradeoff", "scaling", "COLORS"]

COLORS = dict(parameters="#4C72B0", gradients="#DD8452", optimizer="#55A868", activations="#C44E52",
              kv_cache="#8172B3", other="#937860")


def _axes(ax):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(7, 3.5))
    return ax


def _unit(n):
    return (GiB, "GiB") if n >= GiB else (MiB, "MiB")


def _parts(x):
    """Category bytes from a tracker (at its peak), an Estimate (at its peak) or a dict."""
    if isinstance(x, dict):
        parts = x
    elif hasattr(x, "peak_parts"):
        parts = x.peak_parts
    else:
        raise TypeError(f"expected a track() report, an estimate or a dict of bytes, got {type(x).__name__}")
    unknown = set(parts) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; expected some of {CATEGORIES}")
    return parts


def breakdown(*bars, labels=None, ax=None, title="Memory at the peak"):
    """Stacked bars by category, e.g. `breakdown(est, mem, labels=["estimated", "measured"])`."""
    if not bars:
        raise ValueError("breakdown needs at least one report, estimate or dict")
    labels = labels or [type(b).__name__ for b in bars]
    if len(labels) != len(bars):
        raise ValueError(f"labels must have one name per bar ({len(bars)}), got {labels!r}")
    parts = [_parts(b) for b in bars]
    scale, unit = _unit(max(sum(p.values()) for p in parts))
    ax = _axes(ax)
    bottoms = [0.0] * len(parts)
    for cat in CATEGORIES:
        vals = [p.get(cat, 0) / scale for p in parts]
        if any(vals):
            ax.bar(labels, vals, bottom=bottoms, label=cat, color=COLORS[cat])
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:.2f} {unit}", ha="center", va="bottom")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    return ax


def timeline(mem, ax=None, title="Live memory, op by op"):
    """Stacked area of live bytes by category over the events of a `track()` block, with its marks."""
    tl = mem.timeline
    start = next((i for i, text in mem.marks if text == "start"), 0)   # what existed before: one step
    scale, unit = _unit(max(tl["total"].max(), 1))
    ax = _axes(ax)
    cats = [c for c in CATEGORIES if tl[c].any()]
    x = range(len(tl["total"]) - start)
    ax.stackplot(x, *[tl[c][start:] / scale for c in cats], labels=cats, colors=[COLORS[c] for c in cats],
                 step="post")
    # A spike a few events wide (the loss gradient at the start of backward) is thinner than a pixel
    # of the stacked area; the total as a line and the peak as a dot keep it visible.
    total = tl["total"][start:] / scale
    ax.step(x, total, where="post", color="black", lw=0.6, label="total")
    top = int(total.argmax())
    ax.plot([top], [total[top]], "v", color="black", ms=5, label=f"peak {total[top]:.3g} {unit}")
    last = -len(x)
    for i, text in mem.marks:
        if text not in ("start", "end") and i - start - last > 0.03 * len(x):   # no overlapping labels
            last = i - start
            ax.axvline(last, color="grey", lw=0.6, ls=":")
            # Near the bottom, on a light box: the top is where the peak marker and spikes sit.
            ax.text(last, ax.get_ylim()[1] * 0.02, text, rotation=90, va="bottom", ha="right", fontsize=8,
                    bbox=dict(facecolor="white", alpha=0.7, lw=0, pad=1))
    ax.set_xlabel("event (allocation or free)")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    return ax


def tradeoff(table, ax=None, title="Time against peak memory", highlight=()):
    """Scatter of time against peak for the rows of a `compare()` table (or {name: Result}).

    highlight: names of rows to circle (e.g. the schedule a rule of thumb recommends).
    """
    results = getattr(table, "results", table)
    highlight = [highlight] if isinstance(highlight, str) else list(highlight)
    unknown = [h for h in highlight if h not in results]
    if unknown:
        raise ValueError(f"highlight must name rows of the table {list(results)}, got {unknown}")
    ax = _axes(ax)
    scale, unit = _unit(max(r.peak for r in results.values()))
    for name, r in results.items():
        ax.scatter(r.peak / scale, r.time_s * 1e3)
        ax.annotate(name, (r.peak / scale, r.time_s * 1e3), textcoords="offset points", xytext=(4, 4))
        if name in highlight:
            ax.scatter(r.peak / scale, r.time_s * 1e3, s=250, facecolors="none", edgecolors="red")
    ax.set_xlabel(f"peak ({unit})")
    ax.set_ylabel("time (ms)")
    ax.set_title(title)
    return ax


def scaling(x, series, xlabel="x", ylabel="bytes", log=True, ax=None, title=None):
    """Lines of `series` ({name: values}) against `x`, log-log by default (a power law is a line)."""
    ax = _axes(ax)
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(x)} x values")
        ax.plot(x, ys, marker="o", label=name)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(frameon=False)
    return ax
