"""Click parameter types both commands use (`gcwrap` and `gcshadow`), so
neither command-line module imports the other."""

from __future__ import annotations

from typing import Any

import click


class Size(click.ParamType):  # type: ignore[type-arg]
    """A size as people write it (4096, 8MiB, 100MB; see gcwrap.units), at
    least `minimum` (written the same way) if one is given."""

    name = "SIZE"

    def __init__(self, minimum: str | None = None) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from .units import parse_size

        try:
            size = value if isinstance(value, int) else parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if self.minimum is not None and size < parse_size(self.minimum):
            self.fail(f"{value!r} is too small: give at least {self.minimum}", param, ctx)
        return size
