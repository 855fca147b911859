"""`python -m engine.replay DUMP [--set key=value ...]`: replay a flight-recorder dump.

Rebuilds the scheduler from the dump's recorded options with a stand-in model that returns the
recorded tokens, feeds the recorded messages in order, and checks every scheduling decision.
Exit status: 0 when every decision matches, 1 at the first divergence (printed with the events
before it), 2 when the dump cannot be replayed. `--set` changes an option for the replay (e.g.
`--set schedule_policy=fcfs`: what would that policy have decided differently?).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.recorder.replay import Replayer, ReplayError
from engine.recorder.ring import load_dump


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="a flight-recorder dump (flight-<time>.msgpack)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a server option")
    p.add_argument("--context", type=int, default=8, help="events shown before a divergence (default: 8)")
    ns = p.parse_args(argv)
    overrides = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key.strip()] = _value(value)
    try:
        dump = load_dump(ns.dump)
        redacted = "" if dump.header.prompts_recorded else ", prompts redacted"
        print(f"{ns.dump}: {len(dump.events)} events recorded by {dump.header.build} ({dump.reason}{redacted})")
        report = Replayer(dump, overrides, ns.context).run()
    except (ReplayError, OSError, ValueError) as e:
        print(f"cannot replay: {e}", file=sys.stderr)
        return 2
    print(
        f"replayed {report.events} events: {report.decisions} decisions over {report.steps} batches "
        f"and {report.requests} requests"
    )
    if report.divergence is None:
        print("0 divergences")
        return 0
    print(report.divergence.describe())
    return 1


if __name__ == "__main__":
    sys.exit(main())
