"""`python -m sglang.launch_server`, test-only: parse SGLang's command line strictly (an unknown flag, or one whose
value does not parse, exits 2 with argparse's message, in the server's log), print what was parsed (the key left
out), and serve the model with slimeflow's embedded engine on the given host and port. The engine exits when the
process that started it (the EngineActor) is gone, as SGLang's server does with its parent."""

import argparse
import dataclasses
import os
import sys

from sglang.srt.server_args import ServerArgs


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    for field in dataclasses.fields(ServerArgs):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=field.type, default=field.default, required=field.name == "model_path")
    return ServerArgs(**vars(parser.parse_args(argv)))


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.tp_size * args.pp_size != 1:
        sys.exit(f"sglang.launch_server (test stand-in): tp_size {args.tp_size} x pp_size {args.pp_size}: the embedded "
                 "engine serves on one device")
    shown = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    print(f"sglang.launch_server (test stand-in) parsed {shown}", flush=True)
    from slimeflow.engine.server import main as serve

    serve(["--model-path", args.model_path, "--host", args.host, "--port", str(args.port),
           "--seed", str(args.random_seed), "--parent-pid", str(os.getppid()),
           *([f"--api-key={args.api_key}"] if args.api_key else []),
           *(["--context-length", str(args.context_length)] if args.context_length else [])])


if __name__ == "__main__":
    main(sys.argv[1:])
