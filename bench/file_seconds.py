"""Seconds per test file from a pytest JUnit report, as ``tests/file_seconds.json`` holds them (the
order in which ``make test``'s workers take the files: longest first).

    python -m pytest -n 0 --junitxml=/tmp/suite.xml
    python bench/file_seconds.py /tmp/suite.xml > tests/file_seconds.json

A one-process run (``-n 0``) gives each file's own time; a two-worker run (``make test``'s) gives
the times the workers see, each file slowed by whatever ran beside it. Either balances the workers;
the file holds a two-worker run's.
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET


def file_seconds(report: str) -> dict[str, int]:
    """``{test file name: whole seconds}`` (setup, call and teardown of its tests), longest first."""
    seconds: collections.Counter = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds[case.get("classname").split(".")[-1] + ".py"] += float(case.get("time"))
    return {name: round(total) for name, total in seconds.most_common() if total >= 1}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="pytest --junitxml file")
    print(json.dumps(file_seconds(parser.parse_args().report), indent=1))
