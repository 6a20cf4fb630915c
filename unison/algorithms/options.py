"""Checks of an algorithm's options, and the options given by name or alias.

An algorithm's options are the fields of its dataclass (``Algorithm``
subclasses are keyword-only dataclasses); its ``__post_init__`` checks each
with a helper here, so every algorithm words its errors alike.

Example::

    class LocalSGD(Algorithm[LocalSGDState]):
        period: int = 16

        def __post_init__(self) -> None:
            options.integer("period", self.period)
            super().__post_init__()

``LocalSGD(period=0)`` raises ``ValueError("period must be a positive integer, got 0")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional


class OptionError(ValueError):
    """A value an option does not take: ``"<option> must be <must>, got <value>"``.

    Args:
        option: the option's name, as the user wrote it.
        must: what the value must be ("a positive integer").
        value: the value given.
        note: said after the value (which names mean the same option).
    """

    def __init__(self, option: str, must: str, value: Any, note: str = "") -> None:
        super().__init__(f"{option} must be {must}, got {value!r}{note}")
        self.option, self.must, self.value = option, must, value


def integer(option: str, value: Any, minimum: int = 1, *, optional: bool = False, what: Optional[str] = None) -> None:
    """Refuse ``value`` unless it is an integer of at least ``minimum`` (a bool is not an integer here);
    ``optional`` also takes None; ``what`` words the requirement (default: from ``minimum``)."""
    if (optional and value is None) or (_is_int(value) and value >= minimum):
        return
    what = what or (
        "a positive integer"
        if minimum == 1
        else "a non-negative integer"
        if minimum == 0
        else f"an integer of at least {minimum}"
    )
    raise OptionError(option, what + (" or None" if optional else ""), value)


def number(
    option: str,
    value: Any,
    low: float = 0.0,
    *,
    open_low: bool = True,
    high: Optional[float] = None,
    optional: bool = False,
) -> None:
    """Refuse ``value`` unless it is a finite real number above ``low`` (at least ``low`` when not
    ``open_low``) and below ``high``; ``optional`` also takes None."""
    if optional and value is None:
        return
    ok = _is_number(value) and (value > low if open_low else value >= low)
    if ok and (high is None or value < high):
        return
    if high is not None:
        what = f"a number in {'(' if open_low else '['}{low:g}, {high:g})" + (" or None" if optional else "")
    elif low == 0 and open_low:
        what = "a positive number"
    else:
        what = f"a number {'above' if open_low else 'of at least'} {low:g}"
    raise OptionError(option, what, value)


def boolean(option: str, value: Any) -> None:
    """Refuse ``value`` unless it is True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise OptionError(option, "True or False", value)


def choice(option: str, value: Any, choices: Sequence[Any]) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (True is not 1 here)."""
    try:
        allowed = value in choices
    except TypeError:  # an unhashable or uncomparable value
        allowed = False
    if not (allowed and isinstance(value, bool) == any(isinstance(c, bool) and c == value for c in choices)):
        raise OptionError(option, "one of " + ", ".join(map(repr, choices)), value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def resolve(
    algorithm: str, declared: Sequence[str], aliases: Mapping[str, Sequence[str]], given: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Options given by name or alias, by name: ``(values, {name: the alias it was given by})``.

    Raises ValueError naming an unknown option (with the allowed ones, aliases
    included), or one given twice under two names.
    """
    by_name = {alias: name for name in declared for alias in (name, *aliases.get(name, ()))}
    unknown = sorted(k for k in given if k not in by_name)
    if unknown:
        listing = [name + (f" (alias {', '.join(aliases[name])})" if aliases.get(name) else "") for name in declared]
        raise ValueError(
            f"algorithm {algorithm!r} has no option {', '.join(map(repr, unknown))}; "
            f"allowed options: {', '.join(listing) or 'none'}"
        )
    values: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in given.items():
        name = by_name[key]
        if name in values:
            raise ValueError(f"option {name!r} of {algorithm!r} was given twice, as {written[name]!r} and {key!r}")
        values[name], written[name] = value, key
    return values, {name: key for name, key in written.items() if key != name}


def as_given(error: OptionError, given_as: Mapping[str, str], aliases: Mapping[str, Sequence[str]]) -> OptionError:
    """``error`` naming its option as the user wrote it, and saying which names mean that option."""
    names = (error.option, *aliases.get(error.option, ()))
    if len(names) == 1:
        return error
    note = f" ({' and '.join(names)} name the same option)"
    return OptionError(given_as.get(error.option, error.option), error.must, error.value, note)


class Option:
    """The earlier way to declare an option (``period = Int(16)`` as a class attribute), kept for
    algorithms written against it: ``Algorithm`` turns each into a dataclass field checked by
    ``check`` after ``__post_init__``, with a DeprecationWarning. New code declares typed fields.

    Args:
        default: the value when the option is not given.
        aliases: other names ``create`` accepts for it.
    """

    def __init__(self, default: Any, aliases: Sequence[str] = ()) -> None:
        self.default, self.aliases = default, tuple(aliases)

    def check(self, option: str, value: Any) -> None:
        """Refuse a value the option does not take (raise OptionError)."""


class Int(Option):
    """An integer of at least ``minimum`` (``integer``'s check); ``optional`` also takes None."""

    def __init__(self, default: Any, minimum: int = 1, optional: bool = False, what: Optional[str] = None, **kw: Any):
        super().__init__(default, **kw)
        self.minimum, self.optional, self.what = minimum, optional, what

    def check(self, option: str, value: Any) -> None:
        integer(option, value, self.minimum, optional=self.optional, what=self.what)


class Number(Option):
    """A finite number in a range (``number``'s check)."""

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

    def check(self, option: str, value: Any) -> None:
        number(option, value, self.low, open_low=self.open_low, high=self.high, optional=self.optional)


class Bool(Option):
    """True or False (``boolean``'s check)."""

    def check(self, option: str, value: Any) -> None:
        boolean(option, value)


class Choice(Option):
    """One of a few values (``choice``'s check)."""

    def __init__(self, default: Any, choices: Sequence[Any], **kw: Any) -> None:
        super().__init__(default, **kw)
        self.choices = tuple(choices)

    def check(self, option: str, value: Any) -> None:
        choice(option, value, self.choices)
