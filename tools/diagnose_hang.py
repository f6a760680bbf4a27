#!/usr/bin/env python3
"""Merge the p2p flight records a hung pipeline job wrote and name what is stuck.

    python tools/diagnose_hang.py DIR

DIR holds the ``rank<N>.json`` files the p2p watchdog writes (--p2p-timeout-seconds).
Prints a rank that wrote no record while others wait on it (it died), the first message one
side posted and the other never did (or that crossed), then what each rank is stuck in. Exit
status 0 when one of those was found, 1 otherwise.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.hang_diagnosis import diagnose, load_dumps  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the watchdog wrote rank<N>.json")
    args = parser.parse_args(argv)
    dumps = load_dumps(args.directory)
    if not dumps:
        print(f"no rank*.json flight records in {args.directory}", file=sys.stderr)
        return 2
    lines = diagnose(dumps)
    print("\n".join(lines))
    found = ("unmatched", "crossed", "wrote no flight record")
    return 0 if any(word in line for line in lines for word in found) else 1


if __name__ == "__main__":
    sys.exit(main())
