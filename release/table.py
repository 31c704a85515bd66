"""Prints the per-file table of release/run.sh from pytest's JUnit XML (collected, passed, failed).

Every ``*.xml`` in the results folder counts, each test case under the file it came from (the
``file`` of JUnit's xunit1 family: run.sh runs vllm-ascend's unit-test files together, in one
pytest, and each of its precision files alone).
"""

from __future__ import annotations

import collections
import datetime
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(results: Path) -> dict[str, collections.Counter[str]]:
    """Per test file (its path as pytest ran it): its cases by outcome, and ``tests`` in all."""
    by_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for xml in sorted(results.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            file = case.get("file")
            if file is None:
                continue
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            else:
                outcome = "skipped" if case.find("skipped") is not None else "passed"
            counted = by_file[file]
            counted[outcome] += 1
            counted["tests"] += 1
    return by_file


def main(results: Path, files: list[str]) -> None:
    version = os.environ.get("VLLM_ASCEND_VERSION", "0.23.0.post1")
    by_file = outcomes(results)
    print(f"| vllm-ascend {version} test file ({datetime.date.today()}) | collected | passed | failed | skipped |")
    print("|---|---|---|---|---|")
    for f in files:
        # pytest names a case's file from its rootdir: the sdist's, or a folder above it
        # holding pytest's configuration (this checkout, where the environment lives in it)
        ran = [c for path, c in by_file.items() if path == f or path.endswith("/" + f)]
        if not ran:
            print(f"| `{f}` | not run | | | |")
            continue
        c = ran[0]
        print(f"| `{f}` | {c['tests']} | {c['passed']} | {c['failed']} | {c['skipped']} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
