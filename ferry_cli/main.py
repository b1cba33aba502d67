"""The ``ferry`` command: one entry point, one module per subcommand.

Subcommands import lazily so ``ferry plan`` never pays for torch and
``ferry keys`` never starts a server.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("ferry_cli.serve", "run the whole stack: redis, scheduler, workers, gateway"),
    "bench": ("loadtests.cli", "load tests: scenarios, rate sweeps, experiments"),
    "plan": ("ferry_cli.plan", "capacity planning: which device fits a model, context and concurrency"),
    "keys": ("services.gateway.admission.keys_cli", "manage API keys stored in Redis"),
}


def usage() -> str:
    lines = ["usage: ferry <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"ferry: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
