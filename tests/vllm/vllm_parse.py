"""Run in vLLM's virtualenv (not ours): parse each command line of a JSON list given on stdin with
vLLM's own server parser (`make_arg_parser(FlexibleArgumentParser())`, as `vllm serve` builds it) and
print, for each, the settings the flag-parity tests compare (tests/worker/vllm_flag_cases.py), or
the parser's error. Also prints the parser's option strings. Imports nothing of lorafleet."""

import contextlib
import io
import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

SETTINGS = json.loads(sys.argv[1])


def settings(argv: list[str]) -> dict:
    parser = make_arg_parser(FlexibleArgumentParser())
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        return {"error": err.getvalue().strip().splitlines()[-1]}
    out = {}
    for key in SETTINGS:
        value = getattr(ns, key)
        if key == "lora_modules" and value is not None:
            value = [[m.name, m.path] for m in value]
        out[key] = value
    return out


cases = json.loads(sys.stdin.read())
parser = make_arg_parser(FlexibleArgumentParser())
flags = sorted(s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help"))
print(json.dumps({"flags": flags, "cases": [settings(argv) for argv in cases]}))
