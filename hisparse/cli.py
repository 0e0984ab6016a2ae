"""``hisparse``: the user-facing command (``demo``, ``plan``).

Each subcommand lives in its own module with a ``main(argv) -> int``; this
file only dispatches, so that ``hisparse plan`` never imports the client and
``hisparse demo`` never imports the simulator.
"""

from __future__ import annotations

import importlib
import sys

from hisparse import pipes

_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hisparse.demo", "a daemon and two engines sharing a prefix"),
    "plan": ("hisparse.sim.plan_cli", "capacity planner: running requests, host memory, PCIe time"),
}


def _usage() -> str:
    lines = ["usage: hisparse COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return pipes.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _SUBCOMMANDS:
        print(f"hisparse: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
