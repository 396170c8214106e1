"""Benchmark harness: experiment files → isolated runs → results/ → reports/.

The harness measures; ``optim`` (which never imports the harness) holds the optimizations.
"""
