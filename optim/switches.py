"""Switch declarations shared by the optim modules.

A switch has a name, its valid choices, a default and an environment variable. A value is
taken from, in order: the keyword passed to ``enable``, the environment variable, the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    name: str
    choices: tuple[Any, ...]
    default: Any
    help: str
    env: str = ""

    @property
    def env_var(self) -> str:
        return self.env or f"OPTIM_{self.name.upper()}"

    def parse(self, raw: Any) -> Any:
        """Validate a value (from code or an environment string) against the choices."""
        value = raw
        if isinstance(raw, str):
            low = raw.strip().lower()
            if True in self.choices and low in ("1", "true", "on", "yes"):
                value = True
            elif False in self.choices and low in ("0", "false", "off", "no"):
                value = False
            else:
                value = low
        if value not in self.choices:
            raise ValueError(
                f"{self.name}={raw!r} is not valid (valid: {', '.join(map(str, self.choices))})"
            )
        return value

    def resolve(self, explicit: Any = None) -> Any:
        if explicit is not None:
            return self.parse(explicit)
        if self.env_var in os.environ:
            return self.parse(os.environ[self.env_var])
        return self.default
