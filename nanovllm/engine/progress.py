"""generate()'s progress bar: `use_tqdm` as vLLM takes it, a bool or a tqdm-like factory."""
from tqdm.auto import tqdm


def check_use_tqdm(use_tqdm: object) -> None:
    """Refuse a use_tqdm that is neither a bool nor callable (a truthy string would show a bar)."""
    if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
        raise TypeError(f"use_tqdm={use_tqdm!r}: expected a bool or a callable that makes a "
                        "tqdm-like bar (tqdm's keyword arguments; update, set_postfix, close)")


def progress_bar(use_tqdm, total: int):
    """A bar over `total` requests: tqdm's (disabled when use_tqdm is False) or use_tqdm's
    (generate() ran check_use_tqdm first, before any work)."""
    if callable(use_tqdm):  # called as vLLM calls it: no `disable`
        return use_tqdm(total=total, desc="Generating", dynamic_ncols=True)
    return tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
