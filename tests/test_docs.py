"""The README is a front door into docs/: its links resolve, its example is the one the tests run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    for page in _docs():
        for target in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: link to {target} does not resolve"


def test_the_readme_stays_a_front_door_that_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260, "reference material belongs in docs/"
    linked = set(LINK.findall(readme))
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name == "mutation.md":  # linked from docs/development.md
            continue
        assert f"docs/{doc.name}" in linked, f"README does not link docs/{doc.name}"


def test_the_readme_quickstart_is_the_example_the_tests_run():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("[`examples/quickstart.py`](examples/quickstart.py)", 1)[1].split("```python\n", 1)[1]
    code = block.split("```", 1)[0]
    example = (ROOT / "examples" / "quickstart.py").read_text()
    for line in code.strip().splitlines():
        assert line.strip() in example, f"README quickstart line not in examples/quickstart.py: {line!r}"
