"""A CSV cell past the reader's limit, through the real CLI: Python's own limit (128 KiB) said
"unreadable (field larger than field limit (131072))"; spill reads cells up to 16 MiB (real
text) and refuses a longer one in one line naming its line, its column, its size and the limit,
in bounded memory, before anything is built."""

from __future__ import annotations

import shutil

from tests.func.test_input_bombs import ROOT, measured

CELL = 18_000_000  # characters, past the 16 MiB limit


def test_a_cell_past_16_mib_is_one_line_naming_line_column_and_size(tmp_path):
    project = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", project, ignore=shutil.ignore_patterns(".spill"))
    data = project / "toy.csv"
    lines = data.read_text().count("\n")
    with open(data, "a") as f:
        f.write('"' + "w " * (CELL // 2) + '",big\nchair window tiger blue,big\n')
    ran = measured("build", str(project), home=tmp_path / "home")
    assert ran.code == 1
    assert ran.one_line() == (
        f"spill: error: {data}: line {lines + 1}, column 'text': a cell of {CELL:,} characters, "
        "past the limit of 16,777,216 for one cell; shorten it or split the row (a quote left "
        "open before it makes the rest of the file one cell)"
    )
    assert not (project / ".spill").exists()  # peak RSS and time: measured's bounds (151 MB
    # and 0.9 s alone here; a forked child's ru_maxrss starts from its parent's, pytest's)
