"""The `warmfleet` command: dispatches subcommands to their modules, importing only what each needs."""

from __future__ import annotations

import argparse
import sys

# subcommand -> (module, one-line help); each module defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "serve": ("warmfleet.server.api.main", "Run one replica: engine + OpenAI-compatible HTTP API."),
    "route": ("warmfleet.server.router.http.main", "Run the cache-affinity router in front of replicas."),
    "epp": ("warmfleet.server.router.epp.main", "Run the Endpoint Picker of a Gateway API InferencePool (Envoy ext_proc, gRPC)."),
    "envoy-bootstrap": ("warmfleet.server.router.epp.envoy_bootstrap", "Print an Envoy bootstrap that routes through `warmfleet epp`."),
    "node-tier": ("warmfleet.server.nodetier.server", "Run a node's shared cache of KV blocks and encoder outputs (TCP + KV events)."),
    "operator": ("warmfleet.operator.wiring.command", "Run the kopf operator, or render its objects offline."),
    "fetch-model": ("warmfleet.fetch", "Download an hf:// or s3:// model into a cache directory (resumable, verified)."),
    "make-tiny-model": ("warmfleet.server.tiny_checkpoints.cli", "Write a random Hugging Face checkpoint for tests and demos."),
    "demo": ("warmfleet.demo", "Start a local fleet on a tiny checkpoint (no cluster needed)."),
    "doctor": ("warmfleet.doctor", "Check this machine: Python, Paddle, CPU, memory for the caches, test and e2e tools."),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("warmfleet")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="warmfleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"warmfleet {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == wanted:  # import only the chosen subcommand's module
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    mod = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:  # bad flag values or paths: one readable line
        print(f"warmfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
