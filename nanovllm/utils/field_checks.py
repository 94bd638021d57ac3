"""Field checks shared by Config, SamplingParams and request validation.

One contract: a value is accepted only if its device representation holds it (int32 counts,
int64 ids and seeds, float32 sampling parameters), and every refusal is a ValueError of the form
"<field>=<value> is invalid: expected <what is allowed>".
"""
import math
from numbers import Integral, Real

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: GPUs may flush smaller to 0


def is_int(value: object) -> bool:
    """Python and numpy integers; not bools, though bool subclasses int."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Python and numpy ints and floats; not bools, not tensors."""
    return isinstance(value, Real) and not isinstance(value, bool)


def describe(value: object, width: int = 60) -> str:
    """repr (shortened) and type name, for error messages."""
    return f"{_short_repr(value, width)} ({type(value).__name__})"


def invalid(name: str, value: object, allowed: str) -> ValueError:
    """The one error shape for a bad field."""
    return ValueError(f"{name}={_short_repr(value)} is invalid: expected {allowed}")


def check(name: str, value: object, ok: bool, allowed: str) -> None:
    """Raise `invalid(...)` unless ok."""
    if not ok:
        raise invalid(name, value, allowed)


def check_int(name: str, value: object, low: int, high: int | None = INT32_MAX,
              allowed: str | None = None) -> int:
    """An int in [low, high] (high None: unbounded), returned as a Python int."""
    ok = is_int(value) and low <= value and (high is None or value <= high)
    check(name, value, ok, allowed or f"an int in [{low}, {high}]")
    return int(value)


def check_real(name: str, value: object, low: float, high: float, allowed: str,
               low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] if low_open) as a Python float."""
    # NaN fails every comparison; ints beyond float range (10**400) are compared exactly.
    ok = is_real(value) and (low < value if low_open else low <= value) and value <= high
    check(name, value, ok and math.isfinite(float(value)), allowed)
    return float(value)


def _short_repr(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
