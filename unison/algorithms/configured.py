"""Configuration objects whose options are declared once as ``options.Option`` attributes:
the one generic check of what was given, and the values read back.

Example::

    class LocalSGD(Algorithm):
        period = Int(16, aliases=("communication_interval",))

``LocalSGD(period=0)`` raises ``ValueError("period must be a positive integer, got 0")``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .options import Option


class Configured:
    """An object configured by declared ``Option`` attributes (an Algorithm): it holds the values
    given, checked, and reads each back converted through its Option."""

    name: ClassVar[str] = "base"
    #: Every option with its default (filled in for each subclass from its declarations).
    defaults: ClassVar[dict[str, Any]] = {}
    options_declared: ClassVar[dict[str, Option]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options_declared = declared(cls)
        cls.defaults = {name: o.default for name, o in cls.options_declared.items()}

    def __init__(self, **options: Any) -> None:
        #: Every option's value as given (canonical name -> value; each Option converts on reading).
        self.option_values, self._written = check_given(self.name, type(self).options_declared, options)

    @property
    def options(self) -> dict[str, Any]:
        """The options, each under the name it was given by (its canonical name when not given)."""
        return {self._written.get(name, name): value for name, value in self.option_values.items()}

    def describe(self) -> str:
        """A stable text naming the algorithm and its options, compared across ranks."""
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in sorted(self.option_values.items()))})"


def declared(cls: type) -> dict[str, Option]:
    """The options of an algorithm class: its own in declaration order, then inherited ones
    (a subclass drops an inherited option by setting it to None)."""
    out: dict[str, Option] = {}
    dropped: set[str] = set()
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if isinstance(value, Option) and name not in out and name not in dropped:
                out[name] = value
            elif value is None and name not in out:
                dropped.add(name)
    return out


def check_given(
    algorithm: str, options: dict[str, Option], given: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Check ``given`` against ``options``: (canonical values, canonical name -> the name written).

    Raises ValueError naming an unknown option (with the allowed ones), one
    given twice under two names, or a value that is not allowed.
    """
    by_name = {alias: name for name, o in options.items() for alias in (name, *o.aliases)}
    unknown = sorted(k for k in given if k not in by_name)
    if unknown:
        allowed = ", ".join(_listing(o) for o in options.values()) or "none"
        raise ValueError(
            f"algorithm {algorithm!r} has no option {', '.join(map(repr, unknown))}; allowed options: {allowed}"
        )
    values = {name: o.default for name, o in options.items()}
    written: dict[str, str] = {}
    for key, value in given.items():
        name = by_name[key]
        if name in written:
            raise ValueError(f"option {name!r} of {algorithm!r} was given twice, as {written[name]!r} and {key!r}")
        written[name] = key
        option = options[name]
        problem = option.check(value)
        if problem is not None:
            names = (name, *option.aliases)
            also = f" ({' and '.join(names)} name the same option)" if len(names) > 1 else ""
            raise ValueError(f"{key} must be {problem}, got {value!r}{also}")
        values[name] = value
    return values, written


def _listing(option: Option) -> str:
    return option.name + (f" (alias {', '.join(option.aliases)})" if option.aliases else "")
