"""README's feature matrix (drawn by docs/make_matrix.py from tests/test_matrix.py's results)
lists exactly the matrix's rows and columns (tests/matrix_spec.py): a new feature or family
cannot be left out of it. Reads the file only; runs nothing."""

import pathlib
import re

from matrix_spec import FAMILIES, NOT_APPLICABLE, PATHS_NOT_APPLICABLE, row_title, rows

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_lists_the_matrix():
    """The table between the matrix markers has exactly the matrix's rows and columns, in
    order, says n/a in every cell that does not apply and ✓ or ✗ in every other; the capture
    paths that are no column are named below it."""
    section = re.search(r"<!-- matrix:start -->(.*?)<!-- matrix:end -->", README.read_text(), re.S)
    assert section, "README.md has no <!-- matrix:start --> ... <!-- matrix:end --> section"
    table = [line for line in section.group(1).splitlines() if line.startswith("|")]
    split = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    header, body = split[0], split[2:]
    assert header[1:] == [f.header for f in FAMILIES]
    assert [r[0] for r in body] == [row_title(f, s) for f, s in rows()]
    for (feature, size), line in zip(rows(), body):
        for family, text in zip(FAMILIES, line[1:]):
            assert text.startswith("n/a") == ((feature.id, family.id) in NOT_APPLICABLE), (
                feature.id,
                size,
                family.id,
                text,
            )
            assert text.startswith(("✓", "✗", "n/a")), (feature.id, size, family.id, text)
    for path in PATHS_NOT_APPLICABLE:
        assert path in section.group(1)
