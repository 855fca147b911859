"""A replica's command line, rebuilt from the controller's own argv.

Why argv and not the parsed options: a replica must behave exactly as a single server started
with the user's flags would, including flags this module knows nothing about (a flag added to
`server/cli.py` tomorrow is passed through without touching this file). So the user's argv is
kept token for token, minus the flags the controller owns (the data-parallel ones and the
listening address) and minus the ones the resource split overrides, which are then appended
with the replica's own values.

No flag spelling is listed here: options are named by their parsed names (`dp_size`, the
`ServerConfig`/engine field), and a token is matched to its option by the CLI's own parser
(public `argparse` calls only), so an abbreviation (`--dp 2`), the `--flag=value` form and a
value that looks like a flag (`--chunked-prefill-size -1`) are handled the way argparse handles
them. `replica_argv` then re-parses its result and checks that the replica sees the same options
as the controller except the ones it meant to change: a mistake here could start a replica that
is itself a data-parallel controller, so it fails loudly instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from server.cli import build_parser

# Parsed option names the controller owns: it listens, routes and places the replicas itself.
CONTROLLER_ONLY = ("dp_size", "load_balance_method", "ray_address", "host", "port")


class ReplicaArgsError(RuntimeError):
    """The rewritten command line would not give the replica the options it should have."""


class _Options:
    """The CLI parser, probed one flag at a time (it raises instead of exiting on a missing value)."""

    def __init__(self) -> None:
        self.parser = build_parser()
        self.parser.exit_on_error = False
        self.defaults = vars(self.parser.parse_args([]))

    def parse(self, argv: Sequence[str]) -> dict[str, object]:
        return vars(self.parser.parse_args(list(argv)))

    def takes_value(self, flag: str) -> bool:
        try:
            self.parser.parse_known_args([flag], namespace=argparse.Namespace(**self.defaults))
        except argparse.ArgumentError:  # "expected one argument"
            return True
        return False

    def dest_of(self, tokens: list[str]) -> str:
        """The one option `tokens` (a flag, maybe with its value) sets: every option starts as a
        sentinel, and argparse neither fills defaults in over present attributes nor converts
        values that are not the defaults, so exactly the option given changes."""
        sentinel = object()
        ns = argparse.Namespace(**dict.fromkeys(self.defaults, sentinel))
        self.parser.parse_known_args(tokens, namespace=ns)
        changed = [k for k, v in vars(ns).items() if v is not sentinel]
        if len(changed) != 1:
            raise ReplicaArgsError(f"cannot tell which option {' '.join(tokens)!r} sets (got {changed})")
        return changed[0]

    def flag_for(self, dest: str, value: str) -> str:
        """The long flag that sets `dest` (argparse names an option after its first long flag,
        `--torch-threads` -> `torch_threads`), checked against the parser with `value`."""
        flag = "--" + dest.replace("_", "-")
        try:
            ok = self.dest_of([flag, value]) == dest
        except (argparse.ArgumentError, ReplicaArgsError):
            ok = False
        if not ok:
            raise ReplicaArgsError(f"no flag {flag} sets {dest!r} to {value!r}")
        return flag


def split_options(argv: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """argv as (option name, tokens) pieces in order: a flag with its value, or a lone token
    (name None). argv must already parse (the controller parsed it first)."""
    opts = _Options()
    out: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token in ("-", "--"):
            out.append((None, [token]))
            i += 1
            continue
        tokens = [token]
        if "=" not in token and i + 1 < len(argv) and opts.takes_value(token):
            tokens.append(argv[i + 1])
        out.append((opts.dest_of(tokens), tokens))
        i += len(tokens)
    return out


def replica_argv(argv: Sequence[str], overrides: Mapping[str, str | None], host: str, port: int) -> list[str]:
    """One replica's flags: the user's argv without the controller's options and the overridden
    ones, then `--host`/`--port` and each override (None: drop the user's value, set none).

    Raises `ReplicaArgsError` if the result would not parse to exactly that.
    """
    opts = _Options()
    drop = set(CONTROLLER_ONLY) | set(overrides)
    out = [tok for dest, tokens in split_options(argv) if dest not in drop for tok in tokens]
    settings = {"host": host, "port": str(port), **overrides}
    for dest, value in settings.items():
        if value is not None:
            out += [opts.flag_for(dest, value), value]
    expected = opts.parse(argv)
    for dest in (*CONTROLLER_ONLY, *overrides):
        expected[dest] = opts.defaults[dest]
    for dest, value in settings.items():
        if value is not None:
            expected[dest] = opts.parse([opts.flag_for(dest, value), value])[dest]
    got = opts.parse(out)
    wrong = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
    if wrong:
        raise ReplicaArgsError(f"replica command line {out} sets {wrong} (option: (expected, got))")
    return out


__all__ = ["CONTROLLER_ONLY", "ReplicaArgsError", "replica_argv", "split_options"]
