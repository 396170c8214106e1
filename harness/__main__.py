"""``python -m harness``: the command line (``harness.cli``), and three internal entries the harness
starts itself: ``_point`` (the child process of one sweep point), ``_trainer_run`` (the child
process of one Trainer bench run, ``harness.bench.trainer``) and ``_rounds`` (one side's sweeps for
the revisions gate, ``harness.gate.side``, which runs the command line's sweep)."""

import sys


def _unsloth_first(spec_path: str) -> None:
    """A point (or a Trainer bench run) of the Unsloth stack imports it before torch, transformers
    and peft: it patches them."""
    import json

    try:
        with open(spec_path) as f:
            stack = json.load(f).get("stack")
    except (OSError, ValueError):
        return  # the point's own reading of its spec says what is wrong
    if stack == "unsloth":
        from harness.run import unsloth_stack

        unsloth_stack.import_first()


def _main(argv: list[str]) -> int:
    if argv[:1] == ["_point"]:
        from harness.run.stack_dumps import stacks_on_request

        stacks_on_request()  # before torch's import: a point stopped in it says so too
        _unsloth_first(argv[1])
        from harness.run import point

        return point.main(*argv[1:3])
    if argv[:1] == ["_trainer_run"]:
        _unsloth_first(argv[1])
        from harness.bench import trainer

        return trainer.child(*argv[1:3])
    if argv[:1] == ["_rounds"]:
        from harness.gate import side

        return side.main(argv[1:])
    from harness.cli import main

    return main(argv)


sys.exit(_main(sys.argv[1:]))
