"""Prints the per-file table of release/run.sh from pytest's JUnit XML (collected, passed, failed)."""

from __future__ import annotations

import datetime
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(results: Path, files: list[str]) -> None:
    version = os.environ.get("VLLM_ASCEND_VERSION", "0.23.0.post1")
    print(f"| vllm-ascend {version} test file ({datetime.date.today()}) | collected | passed | failed | skipped |")
    print("|---|---|---|---|---|")
    for f in files:
        xml = results / (Path(f).stem + ".xml")
        if not xml.is_file():
            print(f"| `{f}` | not run | | | |")
            continue
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        print(f"| `{f}` | {tests} | {tests - failed - skipped} | {failed} | {skipped} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
