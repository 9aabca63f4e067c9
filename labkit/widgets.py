"""An interactive memory calculator: sliders over `estimate`, drawn as a live breakdown chart."""
from __future__ import annotations

from .estimate import DTYPES, estimate
from .models import PRESETS, config

__all__ = ["calculator"]


def calculator(preset="llama-2-7b", seq=2048, batch=1, dtype="bf16", optimizer="adamw"):
    """A widget box: preset, sequence length, batch, precision, optimizer, training, recomputation."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from .plot import breakdown
    from .units import fmt_bytes

    controls = dict(
        preset=w.Dropdown(options=sorted(PRESETS), value=preset, description="model"),
        seq=w.IntSlider(value=seq, min=128, max=32768, step=128, description="seq"),
        batch=w.IntSlider(value=batch, min=1, max=64, description="batch"),
        dtype=w.Dropdown(options=list(DTYPES), value=dtype, description="precision"),
        optimizer=w.Dropdown(options=["adamw", "adamw-8bit", "sgd-momentum", "sgd"], value=optimizer,
                             description="optimizer"),
        training=w.Checkbox(value=True, description="training"),
        recompute=w.Checkbox(value=False, description="recompute"),
    )
    out = w.Output()

    def update(_=None):
        v = {k: c.value for k, c in controls.items()}
        est = estimate(config(v["preset"], "full"), v["batch"], v["seq"], v["dtype"],
                       v["optimizer"] if v["training"] else None, v["training"], v["recompute"])
        out.clear_output(wait=True)
        with out:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            breakdown(est, labels=[v["preset"]], ax=ax, title=f"estimated peak {fmt_bytes(est.total)}")
            plt.show()
        box.estimate = est
    for c in controls.values():
        c.observe(update, names="value")
    box = w.HBox([w.VBox(list(controls.values())), out])
    box.controls, box.update = controls, update
    update()
    return box
