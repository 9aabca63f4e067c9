"""An interactive memory calculator: sliders over `estimate`, drawn as a live breakdown chart."""
from __future__ import annotations

from .estimate import DTYPES, estimate
from .models import PRESETS, config

__all__ = ["calculator", "peak_phase", "describe"]


def peak_phase(est):
    """Which moment of the step holds the estimated peak: "optimizer step", "start of backward",
    "recomputation" (training) or "inference"."""
    phase = getattr(est, "phase", None)
    if phase:
        return phase
    p = est.peak_parts
    if not est.parts.get("gradients"):      # no gradients at all: not a training step
        return "inference"
    if p.get("activations") == 0:          # gradients held, activations freed: inside step()
        return "optimizer step"
    return "start of backward" if not p.get("gradients") else "recomputation"


def describe(est):
    """One line: the estimated peak in one unit (the unit of the chart's bars) and the phase holding it."""
    from .plot import _unit
    scale, unit = _unit(est.total)
    return f"estimated peak {est.total / scale:.2f} {unit}, at the {peak_phase(est)}"


def calculator(preset="llama-2-7b", seq=2048, batch=1, dtype="bf16", optimizer="adamw", dp=1, zero=0, tp=1, pp=1):
    """A widget box: preset, sequence length, batch, precision, optimizer, training, recomputation, and the
    parallelism of a training run: data-parallel ranks with their ZeRO stage, tensor and pipeline
    parallel degrees (the estimate is then one rank's memory, batch its micro-batch).

    The box carries the latest `estimate` (`box.estimate`), its one-line summary (`box.title`) and the
    matplotlib figure (`box.figure`); `box.message` holds the error of a combination that has no estimate.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from .plot import breakdown

    def max_seq(name):
        return int(config(name, "full").max_position_embeddings)

    controls = dict(
        preset=w.Dropdown(options=sorted(PRESETS), value=preset, description="model"),
        seq=w.IntSlider(value=min(seq, max_seq(preset)), min=128, max=max_seq(preset), step=128,
                        description="seq"),
        batch=w.IntSlider(value=batch, min=1, max=64, description="batch"),
        dtype=w.Dropdown(options=list(DTYPES), value=dtype, description="precision"),
        optimizer=w.Dropdown(options=["adamw", "adamw-8bit", "sgd-momentum", "sgd"], value=optimizer,
                             description="optimizer"),
        training=w.Checkbox(value=True, description="training"),
        recompute=w.Checkbox(value=False, description="recompute"),
        dp=w.Dropdown(options=[2 ** k for k in range(11)], value=dp, description="DP ranks"),
        zero=w.Dropdown(options=[("0 (DDP)", 0), ("1: optimizer", 1), ("2: + gradients", 2), ("3: + weights", 3)],
                        value=zero, description="ZeRO stage"),
        tp=w.Dropdown(options=[1, 2, 4, 8], value=tp, description="TP degree"),
        pp=w.Dropdown(options=[1, 2, 4, 8, 16], value=pp, description="PP stages"),
    )
    out = w.Output()
    status = w.HTML()

    def update(_=None):
        v = {k: c.value for k, c in controls.items()}
        status.value = "estimating..."   # a family without a formula is measured on fake tensors: seconds
        try:
            est = estimate(config(v["preset"], "full"), v["batch"], v["seq"], v["dtype"],
                           v["optimizer"] if v["training"] else None, v["training"], v["recompute"],
                           dp=v["dp"], zero=v["zero"] if v["training"] else 0, tp=v["tp"], pp=v["pp"])
        except ValueError as e:           # e.g. autocast for inference: say why, keep the last chart
            box.message = status.value = f"no estimate: {e}"
            return
        box.message, box.estimate, box.title = None, est, describe(est)
        status.value = box.title
        out.clear_output(wait=True)
        with out:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            breakdown(est, labels=[v["preset"]], ax=ax, title=box.title)
            box.figure = fig
            plt.show()
        plt.close(fig)

    def new_preset(change):               # the sequence slider ends at the model's context length
        controls["seq"].max = max_seq(change["new"])

    controls["preset"].observe(new_preset, names="value")
    for c in controls.values():
        c.observe(update, names="value")
    box = w.HBox([w.VBox(list(controls.values()) + [status]), out])
    box.controls, box.update, box.message = controls, update, None
    update()
    return box
