"""The reliability figures (docs/reliability.md#figures), measured: attacks tried and held, junk requests and 5xx answers,
and the credit an attacker mints per hour without training.

    python tests/security/report.py [--examples 200] [--attack-seconds 300]

Runs the attack suite (``tests/security``) with ``--examples`` fuzzer examples per operation instead of
the CI budget, then ``attack_credit.py``. Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="fuzzer examples per operation")
    parser.add_argument("--attack-seconds", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        answers = Path(tmp) / "fuzz.json"
        env = dict(os.environ, VOLUNTEER_FUZZ_EXAMPLES=str(args.examples), VOLUNTEER_FUZZ_REPORT=str(answers))
        suite = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/security", "-q", "-p", "no:cacheprovider"],
            cwd=REPO, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        tail = suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else suite.stderr[-500:]
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors)", tail)}
        fuzz = json.loads(answers.read_text()) if answers.exists() else {}
    junk = sum(fuzz.values())
    errors = sum(n for status, n in fuzz.items() if int(status) >= 500 and int(status) not in (503, 504))
    later = sum(n for status, n in fuzz.items() if int(status) in (503, 504))
    print(f"attack suite: {counts.get('passed', 0)} attacks held, {counts.get('failed', 0)} failed ({tail})")
    print(f"fuzzer: {junk} requests ({args.examples} examples per operation), answers {fuzz}")
    print(
        f"5xx: {errors} errors; {later} documented 503/504 'try again later' (generate without a swarm peer)"
    )
    sys.stdout.flush()
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "security" / "attack_credit.py"), "--seconds", str(args.attack_seconds)],
        cwd=REPO, check=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
