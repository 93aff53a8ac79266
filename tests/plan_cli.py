"""`ultrascale ...` in the test's own process, for the planner's tests: the exit code and what it printed."""

import json

from ultrascale.cli import main


def cli(capsys, *args):
    """Run `ultrascale ...` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def memory_json(capsys, *args):
    """`ultrascale plan memory ... --json`, which must succeed, as a dict."""
    code, out, err = cli(capsys, "plan", "memory", *args, "--json")
    assert code == 0, err
    return json.loads(out)
