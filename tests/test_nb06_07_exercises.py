"""Notebook 07's exercises 3 (append) and 4 (copy-on-write): the answer key passes; an answer that calls
labkit.paged's block tables is refused by name; trivial answers fail (issue 28). Notebook 06's 7B footprint
cell counts what lk.estimate says."""
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB07 = ROOT / "notebooks" / "07_kv_cache_paged_attention.ipynb"


def cell(path, text):
    found = [c.source for c in nbformat.read(path, 4).cells if c.cell_type == "code" and text in c.source]
    assert len(found) == 1, f"{path.name}: {len(found)} code cells contain {text!r}"
    return found[0]


def answer_key(text):
    return cell(NB07, text).replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")


def run_check(check_text, answer):
    import labkit as lk
    from labkit import paged
    from labkit.paged import BlockAllocator, BlockTables
    ns = dict(lk=lk, paged=paged, BlockAllocator=BlockAllocator, BlockTables=BlockTables)
    exec(answer, ns)
    exec(cell(NB07, check_text), ns)


APPEND, WRITE = "def check_append():", "def check_write_token():"
CALLS_TABLES = {
    APPEND: "def my_append(allocator, table, length, count):\n"
            "    t = BlockTables(allocator)\n    t.tables['s'], t.lengths['s'] = table, length\n"
            "    t.append('s', count)\n    return t.lengths['s']",
    WRITE: "def my_write_token(allocator, table, length, copies):\n"
           "    t = BlockTables(allocator)\n    t.tables['s'], t.lengths['s'] = table, length\n"
           "    t.append('s', 1)\n    copies.extend(t.take_copies())\n    return t.lengths['s']",
}
TRIVIAL = {
    APPEND: "def my_append(allocator, table, length, count):\n    return length + count",
    WRITE: "def my_write_token(allocator, table, length, copies):\n"          # grows, never copies
           "    if length % allocator.block_size == 0:\n        table.append(allocator.allocate())\n    return length + 1",
}
KEYS = {APPEND: "def my_append(allocator, table, length, count):", WRITE: "def my_write_token(allocator, table, length, copies):"}


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_the_answer_key_passes(check, capsys):
    run_check(check, answer_key(KEYS[check]))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_an_answer_through_the_librarys_block_tables_is_refused(check):
    with pytest.raises(AssertionError, match=r"your answer calls labkit\.paged\.tables"):
        run_check(check, CALLS_TABLES[check])


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_a_trivial_answer_fails_without_being_shown_the_answer(check):
    with pytest.raises(AssertionError, match="(is|are) wrong") as failed:
        run_check(check, TRIVIAL[check])
    assert "expected" not in str(failed.value)


def test_the_checks_hold_no_answer_in_a_global():
    for check in (APPEND, WRITE):
        source = cell(NB07, check)
        body = source.split(check, 1)[1]
        assert "reference" in body and "BlockTables(" in body, "the reference is computed inside the check function"
