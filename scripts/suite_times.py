"""The suite's time per file and per test, from pytest's JUnit XML.

    python -m pytest --junitxml=suite.xml
    python scripts/suite_times.py suite.xml [--top 30] [--write-file-times]

Prints markdown tables (files by total time, the slowest tests); `--write-file-times` stores
the seconds per file in tests/file_times.json, the order in which the suite's workers start
files (longest first). A test's time is setup + call + teardown as pytest measured it, less
its waits for cores (tests/workers.py; recorded as the property titan_core_wait_s): what the
per-test budget counts.
"""

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

FILE_TIMES = Path(__file__).resolve().parent.parent / "tests" / "file_times.json"


def test_file(classname: str) -> str:
    """tests.unit.test_x[.TestClass] -> tests/unit/test_x.py"""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (FILE_TIMES.parent.parent / candidate).is_file():
            return candidate
    return "/".join(parts) + ".py"


def read(path: str) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) of every test case."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = test_file(case.get("classname", ""))
        outcome, waited = "passed", 0.0
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
            for prop in child.iter("property"):
                if prop.get("name") == "titan_core_wait_s":
                    waited = float(prop.get("value", 0.0))
        seconds = float(case.get("time", 0.0)) - waited
        cases.append((file, case.get("name", ""), seconds, outcome))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit_xml")
    ap.add_argument("--top", type=int, default=30, help="slowest tests to list")
    ap.add_argument("--write-file-times", action="store_true", help=f"update {FILE_TIMES.name}")
    args = ap.parse_args(argv)
    cases = read(args.junit_xml)
    if not cases:
        print(f"{args.junit_xml}: no test cases", file=sys.stderr)
        return 2
    by_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds, _ in cases:
        by_file[file].append(seconds)
    total = sum(seconds for *_, seconds, _ in cases)
    counts: dict[str, int] = defaultdict(int)
    for *_, outcome in cases:
        counts[outcome] += 1
    print(f"{len(cases)} tests ({dict(counts)}), {total / 60:.1f} min of test time\n")
    print("| file | tests | seconds | share |\n|---|---:|---:|---:|")
    for file, times in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {file} | {len(times)} | {sum(times):.1f} | {sum(times) / total:.1%} |")
    print(f"\n| slowest {args.top} tests | seconds |\n|---|---:|")
    for file, name, seconds, _ in sorted(cases, key=lambda c: -c[2])[: args.top]:
        print(f"| {file}::{name} | {seconds:.1f} |")
    if args.write_file_times:
        ordered = sorted(by_file.items(), key=lambda kv: -sum(kv[1]))
        FILE_TIMES.write_text(
            json.dumps({f: round(sum(t), 1) for f, t in ordered}, indent=1) + "\n"
        )
        print(f"\nwrote {FILE_TIMES}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
