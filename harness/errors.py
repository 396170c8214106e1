"""Input a user can fix, and how the command line reports it.

Every such problem (a malformed experiment or results file, an unknown experiment, a results folder
it cannot write, a command that needs a GPU on a machine without one) is raised as an
``InputError`` whose message names the file, key or value and what is wrong; ``python -m harness``
prints it as one ``error:`` line and exits 2, having changed no file.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: one line of explanation, exit code 2, nothing written."""
