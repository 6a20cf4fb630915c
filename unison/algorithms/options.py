"""Typed option declarations: each algorithm declares its options once, and one
generic check gives every error message.

Example::

    class LocalSGD(Algorithm):
        period = Int(16, aliases=("communication_interval",))
        hierarchical = Bool(False)

``LocalSGD(period=0)`` raises ``ValueError("period must be a positive integer, got 0")``;
``LocalSGD(communication_interval=4).period`` is 4.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence


class Option:
    """One option: its default, its aliases, and the check of a value.

    Args:
        default: the value when the option is not given.
        aliases: other names accepted for it (HeAT's, Bagua's or DiLoCo's own names).
    """

    def __init__(self, default: Any, aliases: Sequence[str] = ()) -> None:
        self.default = default
        self.aliases = tuple(aliases)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        if instance is None:
            return self
        return self.convert(instance.option_values[self.name])

    def check(self, value: Any) -> Optional[str]:
        """None if ``value`` is allowed, else what it must be ("a positive integer")."""
        return None

    def convert(self, value: Any) -> Any:
        """The value the algorithm uses (after ``check`` passed)."""
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Int(Option):
    """An integer of at least ``minimum`` (bools are not integers here); ``optional`` also takes None;
    ``what`` words the requirement in the error message (default: from ``minimum``)."""

    def __init__(
        self, default: Any, minimum: int = 1, optional: bool = False, what: Optional[str] = None, **kw: Any
    ) -> None:
        super().__init__(default, **kw)
        self.minimum, self.optional, self.what = minimum, optional, what

    def check(self, value: Any) -> Optional[str]:
        if self.optional and value is None:
            return None
        if _is_int(value) and value >= self.minimum:
            return None
        what = self.what or (
            "a positive integer"
            if self.minimum == 1
            else "a non-negative integer"
            if self.minimum == 0
            else f"an integer of at least {self.minimum}"
        )
        return what + (" or None" if self.optional else "")


class Number(Option):
    """A finite real number in the range given (``low`` inclusive unless ``open_low``; ``high`` exclusive);
    ``optional`` also takes None."""

    def __init__(
        self,
        default: Any,
        low: float = 0.0,
        open_low: bool = True,
        high: Optional[float] = None,
        optional: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(default, **kw)
        self.low, self.open_low, self.high, self.optional = low, open_low, high, optional

    def check(self, value: Any) -> Optional[str]:
        if self.optional and value is None:
            return None
        ok = _is_number(value) and (value > self.low if self.open_low else value >= self.low)
        ok = ok and (self.high is None or value < self.high)
        if ok:
            return None
        if self.high is not None:
            return f"a number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g})" + (
                " or None" if self.optional else ""
            )
        if self.low == 0 and self.open_low:
            return "a positive number"
        return f"a number {'above' if self.open_low else 'of at least'} {self.low:g}"


class Bool(Option):
    """True or False (not 1, not "yes")."""

    def check(self, value: Any) -> Optional[str]:
        return None if isinstance(value, bool) else "True or False"


class Choice(Option):
    """One of a few values; ``convert`` maps a choice to what the algorithm uses (names to dtypes)."""

    def __init__(
        self, default: Any, choices: Sequence[Any], convert: Optional[Callable[[Any], Any]] = None, **kw: Any
    ) -> None:
        super().__init__(default, **kw)
        self.choices = tuple(choices)
        self._convert = convert

    def check(self, value: Any) -> Optional[str]:
        try:
            allowed = value in self.choices
        except TypeError:
            allowed = False
        if allowed and (isinstance(value, bool) == any(isinstance(c, bool) and c == value for c in self.choices)):
            return None
        return "one of " + ", ".join(map(repr, self.choices))

    def convert(self, value: Any) -> Any:
        return self._convert(value) if self._convert is not None else value
