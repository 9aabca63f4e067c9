"""Published recipes (data/recipes.csv) and the planner's answer to each: does it fit, and how close is its peak.

Each row holds one published figure: its source (a URL at a fixed commit where the source is a repository),
the exact configuration it was measured or estimated at, the levers that configuration fixes (`levers`,
"name=value;..." over labkit.plan.LEVERS), what the figure is (`kind`: a measured peak, a measured maximum,
a measured KV capacity, an estimate, a claim), which counter it read (`measure`), and the source's own
wording (`claim`). `recipe_answer(row)` asks `plan` the row's question with those levers fixed; the row
agrees when the planner's "fits" is the source's. Its peak is compared where the figure is a measured peak
and the row is fully expressible (`expressible` = "full"; "partly: why" names what the planner lacks).
"""
from __future__ import annotations

import csv
import re

from ..data import DATA_DIR as DATA
from ..units import GiB

__all__ = ["recipes", "parse_levers", "published_bytes", "recipe_answer", "recipes_table", "LAST_TIME",
           "LAST_ANSWER"]

# the three plans of last round's closing note, asked again (model, task, gpu, gpus, seq, batch), and what
# the planner of commit e4acde0 answered (its top plan, run again from that commit): a record, not a result
LAST_TIME = {
    "7B fine-tune on a 24 GB card": ("llama-2-7b", "finetune", "L4", 1, 2048, 4),
    "70B QLoRA on a 48 GB card": ("llama-2-70b", "qlora", "A6000", 1, 2048, 1),
    "70B serving 64 users at 4k on 8 x 80 GB": ("llama-2-70b", "serve", "H100", 8, 4096, 64),
}
LAST_ANSWER = {
    "7B fine-tune on a 24 GB card": "bf16 + fp32 master (mixed), AdamW, full recompute, ZeRO-2, optimizer offload; "
                                    "19.50 GiB (host memory never checked: that offload needs 132 GiB of it)",
    "70B QLoRA on a 48 GB card": "NF4 + double quant, LoRA r=16 (all linears), 8-bit AdamW, full recompute; 43.55 GiB "
                                 "(a flat 10% allocator allowance, the card as 48e9 B)",
    "70B serving 64 users at 4k on 8 x 80 GB": "bf16 weights, 8-bit paged KV, tp=8; 23.29 GiB, 7,041 tok/s (decode "
                                               "only; 8-bit KV ranked above 16-bit by speed alone)",
}


def recipes():
    """The rows of data/recipes.csv, as dicts of strings."""
    with open(DATA / "recipes.csv", newline="") as f:
        return list(csv.DictReader(f))


def _value(text):
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?\d+\.\d*", text):
        return float(text)
    if "+" in text:
        return tuple(text.split("+"))
    return text


def parse_levers(text):
    """{"dtype": "bf16", "targets": ("q", "v"), ...} from "dtype=bf16;targets=q+v;..." (empty: {})."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"levers must read name=value;..., got {item!r} in {text!r}")
        out[name.strip()] = _value(value.strip())
    return out


def published_bytes(text):
    """Bytes of a published figure like "18.9 GiB" or "21.30 GB" (GB: 1e9); None for other figures."""
    m = re.fullmatch(r"([\d.,]+)\s*(GiB|GB)", text.strip())
    if not m:
        return None
    return float(m.group(1).replace(",", "")) * (GiB if m.group(2) == "GiB" else 1e9)


def _model(row):
    from ..data import DATA_DIR
    name = row["model"]
    return str(DATA_DIR.parent / name) if name.startswith("data/") else name


def recipe_answer(row):
    """The planner's answer to one recipe row: {fits, agrees, planner (bytes or tokens), published (bytes or
    tokens), ratio (planner / published, where both are numbers), plan (the plan compared), compared
    (whether the peak is held to the published figure)}."""
    from . import plan
    from .serving import kv_capacity_tokens
    fix = parse_levers(row["levers"])
    host = row["host_memory"] or None
    plans = plan(_model(row), row["task"], row["gpu"], gpus=int(row["gpus"]), seq=int(row["seq"]),
                 batch=int(row["batch"]), host_memory=host, levers=fix)
    chosen = plans.best or min(plans, key=lambda p: p.counted_bytes)
    fits = plans.best is not None
    out = dict(name=row["name"], fits=fits, agrees=fits == (row["expect"] == "fits"), plan=chosen,
               published=None, planner=None, ratio=None, compared=False)
    if row["kind"] == "measured capacity":          # a KV cache's token slots (vLLM's # GPU blocks x 16)
        out["published"] = int(re.sub(r"[^\d]", "", row["published"].split()[0])) * 16
        out["planner"] = kv_capacity_tokens(_model(row), row["gpu"], tp=fix.get("tp", 1))
        out["compared"] = row["expressible"] == "full"
    else:
        figure = published_bytes(row["published"])
        if figure is not None:
            out["published"] = figure
            # what the source's counter saw: the allocator's live bytes (max_memory_allocated, memory
            # active) leave out what it caches; a peak of unstated kind is read as what it serves
            live = row["measure"] in ("max_memory_allocated", "peak memory active")
            out["planner"] = chosen.counted_bytes - (chosen.parts["allocator"] if live else 0)
            out["compared"] = row["kind"] == "measured peak" and row["expressible"] == "full"
    if out["published"] and out["planner"] is not None and row["kind"] in ("measured peak", "measured capacity",
                                                                          "estimate"):
        out["ratio"] = out["planner"] / out["published"]
    return out


def _fmt(value, kind):
    if value is None:
        return "-"
    if kind == "measured capacity":
        return f"{value:,} tok"
    return f"{value / GiB:.1f} GiB"


def recipes_table(rows=None, last_time=True, extra=None):
    """The closing note's table: recipe, source, published, planner, fit agreement (and the peak's ratio
    where it is held to the source), then the three plans of last round as they were and as they are now.
    extra: {column name: function(row, answer) -> short text}, columns added after the planner's (e.g. a
    measurement by labkit.plan.verify of answer["plan"])."""
    rows = recipes() if rows is None else rows
    extra = dict(extra or {})
    lines = [f"{'recipe':<30} {'source':<22} {'published':>16} {'planner':>12} {'ratio':>6} "
             + "".join(f"{name:>14} " for name in extra) + " fit agreement"]
    agree = compared = within = 0
    for row in rows:
        a = recipe_answer(row)
        agree += a["agrees"]
        ok = a["ratio"] is not None and abs(a["ratio"] - 1) <= 0.15
        compared += a["compared"]
        within += a["compared"] and ok
        ratio = f"{a['ratio']:.2f}" if a["ratio"] is not None else "-"
        more = "".join(f"{str(fn(row, a)):>14} " for fn in extra.values())
        lines.append(f"{row['name']:<30} {row['source_name']:<22} {row['published']:>16} "
                     f"{_fmt(a['planner'], row['kind']):>12} {ratio:>6}{'*' if a['compared'] else ' '}{more} "
                     f"{'yes' if a['agrees'] else 'NO'} ({row['expect']}; planner: "
                     f"{'fits' if a['fits'] else 'does not fit'})")
    lines.append(f"fit agreement {agree} of {len(rows)}; peaks held to the source (*): {within} of {compared} "
                 f"within 15%")
    if last_time:
        from . import plan
        lines.append("")
        lines.append("last round's three plans, asked again:")
        for what, args in LAST_TIME.items():
            plans = plan(*args)
            best = plans.best
            now = plans.advice() if best is None else (
                f"{', '.join(best.techniques)}; {best.counted_bytes / GiB:.1f} GiB per GPU"
                + (f", {best.host_bytes / GiB:.0f} GiB of host memory" if best.host_bytes else "")
                + (f", {best.tokens_per_s:,.0f} tok/s" if best.tokens_per_s else f", {best.step_time_s:.1f} s a step"))
            lines += [f"  {what}", f"    then: {LAST_ANSWER[what]}", f"    now:  {now}"]
    return "\n".join(lines)
