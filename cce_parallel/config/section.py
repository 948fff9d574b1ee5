"""The base of the recipe's section dataclasses: ``RecipeError``, whose message starts with the
offending key, and ``Section``, which names that key (``section.field``) when a check fails.
No torch and no kernels, like the whole of cce_parallel.config.
"""


class RecipeError(ValueError):
    """A recipe is invalid; the message starts with the offending key (``section.field``)."""


class Section:
    """Base of the section dataclasses: ``SECTION`` is the YAML key, ``_fail`` names the field."""

    SECTION = ""

    def _fail(self, name: str, message: str):
        raise RecipeError(f"{self.SECTION}.{name}: {message} (got {getattr(self, name)!r})")

    def _positive(self, *names: str, allow_none: bool = False):
        for name in names:
            value = getattr(self, name)
            if value is None and allow_none:
                continue
            if value is None or value <= 0:
                self._fail(name, "must be > 0")

    def _non_negative(self, *names: str):
        for name in names:
            if getattr(self, name) < 0:
                self._fail(name, "must be >= 0")
