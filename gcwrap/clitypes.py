"""Click parameter types both commands use (`gcwrap` and `gcshadow`), so
neither command-line module imports the other."""

from __future__ import annotations

from typing import Any

import click


class Size(click.ParamType):  # type: ignore[type-arg]
    """A size as people write it (4096, 8MiB, 100MB; see gcwrap.units)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from .units import parse_size

        try:
            return parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
