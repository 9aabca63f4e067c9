"""The notebooks quote their two source articles (data/seeds/, with SEEDS.md's English) verbatim.

Every run of Chinese text in a notebook (four or more CJK characters, with short ASCII runs between them, as
the seeds write `RTX 3090的24GB显存`) must occur in a seed file once whitespace is removed, so a quote cannot
drift into a paraphrase; and every seed id a notebook cites (`000-5.2-b`) must be a row of SEEDS.md.
"""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEEDS = ROOT / "data" / "seeds"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CJK = re.compile(r"[^\x00-\x7f]*[\u3400-\u9fff][^\x00-\x7f]*(?:[ -~]{0,12}[^\x00-\x7f]*[\u3400-\u9fff][^\x00-\x7f]*)*")
ID = re.compile(r"\b(00[04]-(?:ch\.?[15]|\d(?:\.\d){0,2})-[a-z])\b")


def _squeeze(text):
    return re.sub(r"\s+", "", text)


def quotes(text):
    """The Chinese runs of `text` worth checking: four or more CJK characters, trimmed of ASCII punctuation."""
    out = []
    for run in CJK.findall(text):
        run = run.strip(" .,:;-'\"()[]`*")
        if sum("\u3400" <= ch <= "\u9fff" for ch in run) >= 4:
            out.append(run)
    return out


def test_the_seeds_are_in_the_repository():
    names = sorted(p.name for p in SEEDS.glob("*.txt"))
    assert names == ["000_4270c563b15a7769.txt", "004_dd3e71f884d47042.txt"], names
    assert (SEEDS / "SEEDS.md").is_file()


def test_the_check_finds_a_paraphrase():
    seeds = _squeeze("".join(p.read_text(encoding="utf-8") for p in SEEDS.glob("*.txt")))
    assert all(_squeeze(q) in seeds for q in quotes("显存利用率提升达70%"))
    assert quotes("显存利用率提高了70%") and not all(_squeeze(q) in seeds for q in quotes("显存利用率提高了70%"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chinese_quote_is_verbatim_from_a_seed(path):
    seeds = _squeeze("".join(p.read_text(encoding="utf-8") for p in SEEDS.glob("*.txt")))
    bad = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        for q in quotes("".join(cell["source"])):
            if _squeeze(q) not in seeds:
                bad.append(f"cell [{i}]: {q[:60]}")
    assert not bad, f"{path.name}: quotes not verbatim in data/seeds/ (copy them from there):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cited_seed_id_is_a_row_of_seeds_md(path):
    ids = set(re.findall(r"^\|\s*`?(00[04]-[^|`\s]+)`?\s*\|", (SEEDS / "SEEDS.md").read_text(encoding="utf-8"), re.M))
    cited = set(ID.findall(path.read_text(encoding="utf-8")))
    assert cited <= ids, f"{path.name} cites seed ids SEEDS.md does not have: {sorted(cited - ids)}"
