"""The kinds of setting values: how each is read from text (environment, flags) and from JSON (the
``COC_CONFIG`` file), checked when a CocConfig is built by hand, and shown.

A table row names its kind; a new setting needs a new kind only when no kind here reads its values.
"""

from __future__ import annotations

from coc_inject.settings.parsers import (AUTO, BOOL_ALLOWED, CUSTOMIZED_ALLOWED, FALSE_WORDS, JSON_BOOL_ALLOWED,
                                         TRUE_WORDS,
                                         PARALLEL_NUM_ALLOWED, SHAPE_COUNT_ALLOWED, SHAPE_KEY_ALLOWED,
                                         TUNE_CANDIDATES_ALLOWED, ConfigError, is_int, is_valid_chunk_count, parse_bool,
                                         parse_customized, parse_json_bool, parse_parallel_num, parse_tune_candidates,
                                         shape_text)




class Kind:
    """Reads, checks and shows one kind of value. Subclasses override what differs.

    ``allowed`` is what the text parser accepts (the reference's text, unless a row says more);
    ``off_words`` are the texts that leave a feature off (the bootstrap does not arm on them).
    """

    off_words: tuple = ()
    switch = False  # a MindSpeed flag of this kind takes no value
    flag_value = True  # what such a flag, given, sets

    def __init__(self, allowed: str, parse=None):
        self.allowed = allowed
        self._parse = parse

    @property
    def json_allowed(self) -> str:
        """What the COC_CONFIG file accepts (for kinds of file keys)."""
        return self.allowed

    def parse(self, variable: str, text: str):
        return self._parse(variable, text) if self._parse else text.strip()

    def from_json(self, where: str, value):
        """A COC_CONFIG file's value (only kinds of file keys read JSON)."""
        raise NotImplementedError(f"{type(self).__name__} values are not read from the config file")

    def accepts(self, value) -> bool:
        """Is ``value`` valid in a CocConfig built by hand (paths and switches are not checked)?"""
        return True

    def checked(self, where: str, value):
        """CocConfig's value for ``value``: normalised, or a ConfigError naming ``where``."""
        if not self.accepts(value):
            raise ConfigError(where, value, self.allowed)
        return value

    def shown(self, value):
        """The value as ``CocConfig.describe`` shows it (plain JSON)."""
        return value

    def text(self, value) -> str:
        """The value as a user would type it (the reference's default)."""
        return str(value)


class Switch(Kind):
    off_words = FALSE_WORDS
    switch = True

    def __init__(self):
        super().__init__(BOOL_ALLOWED, parse_bool)

    @property
    def json_allowed(self):
        return JSON_BOOL_ALLOWED

    def from_json(self, where, value):
        return parse_json_bool(where, value)

    def text(self, value):
        return "true" if value else "false"


class ChunkCount(Kind):
    """A count: an integer >= 1 (1 = off) or auto (stored as AUTO)."""

    off_words = ("1",)

    def __init__(self, allowed: str = PARALLEL_NUM_ALLOWED):
        super().__init__(allowed)

    def parse(self, variable, text):
        try:
            return parse_parallel_num(variable, text)
        except ConfigError:
            raise ConfigError(variable, text, self.allowed) from None

    def accepts(self, value):
        return is_int(value) and (value >= 1 or value == AUTO)

    def shown(self, value):
        return "auto" if value == AUTO else value


class AtLeast(Kind):
    """An integer >= ``minimum``."""

    def __init__(self, minimum: int, allowed: str):
        super().__init__(allowed)
        self.minimum = minimum

    def parse(self, variable, text):
        digits = text.strip()
        if digits.isascii() and digits.isdigit() and int(digits) >= self.minimum:
            return int(digits)
        raise ConfigError(variable, text, self.allowed)

    def from_json(self, where, value):
        if not self.accepts(value):
            raise ConfigError(where, value, self.allowed)
        return value

    def accepts(self, value):
        return is_int(value) and value >= self.minimum


class Choice(Kind):
    """One word of ``choices`` (any case); ``aliases`` map other spellings onto them.

    Without an ``allowed`` text the choices are listed, and a CocConfig built by hand is told
    them without "(any case)" (it takes the stored spelling only).
    """

    def __init__(self, choices: tuple, allowed: str | None = None, aliases: dict | None = None):
        super().__init__(allowed or ", ".join(choices) + " (any case)")
        self.choices = choices
        self.aliases = aliases or {}
        self._checked_allowed = allowed or ", ".join(choices)

    def parse(self, variable, text):
        word = text.strip().lower()
        word = self.aliases.get(word, word)
        if word in self.choices:
            return word
        raise ConfigError(variable, text, self.allowed)

    def accepts(self, value):
        return value in self.choices

    def checked(self, where, value):
        if not self.accepts(value):
            raise ConfigError(where, value, self._checked_allowed)
        return value


class OffOnAuto(Choice):
    """0 (off), 1 (on) or auto, the switch words read as 0 / 1; a MindSpeed flag of it means 1."""

    off_words = FALSE_WORDS
    switch = True
    flag_value = "1"

    def __init__(self, allowed: str):
        super().__init__(("0", "1", "auto"), allowed,
                         {**{word: "0" for word in FALSE_WORDS}, **{word: "1" for word in TRUE_WORDS}})


class ShapeCounts(Kind):
    """Per-shape chunk counts: ``{"[m, k, n]": chunks}``, stored as sorted ((m, k, n), chunks) pairs."""

    def __init__(self):
        super().__init__(CUSTOMIZED_ALLOWED, parse_customized)

    def from_json(self, where, value):
        # Only an object here: a string would be a JSON document nested in JSON.
        if not isinstance(value, dict):
            raise ConfigError(where, value, CUSTOMIZED_ALLOWED, reason="is not a JSON object")
        return parse_customized(where, value)

    def checked(self, where, value):
        # Built by hand (tests, other modules) too: a dict or pairs, normalised to sorted pairs.
        pairs = value.items() if isinstance(value, dict) else value
        normalised = []
        for shape, chunks in pairs:
            shape = tuple(shape)
            if len(shape) != 3 or not all(is_int(d) and d >= 1 for d in shape):
                raise ConfigError(f"{where} key", shape, SHAPE_KEY_ALLOWED)
            if not is_valid_chunk_count(chunks):
                raise ConfigError(f"{where}[{shape!r}]", chunks, SHAPE_COUNT_ALLOWED)
            normalised.append((shape, chunks))
        if len(dict(normalised)) != len(normalised):
            raise ConfigError(where, normalised, "each shape at most once")
        return tuple(sorted(normalised))

    def shown(self, value):
        return {shape_text(shape): "auto" if chunks == AUTO else chunks for shape, chunks in value}


class ChunkCandidates(Kind):
    """Distinct chunk counts >= 2, stored sorted."""

    def __init__(self):
        super().__init__(TUNE_CANDIDATES_ALLOWED, parse_tune_candidates)

    def checked(self, where, value):
        candidates = tuple(value)
        if not candidates or len(set(candidates)) != len(candidates) or not all(
                is_int(c) and c >= 2 for c in candidates):
            raise ConfigError(where, value, self.allowed)
        return tuple(sorted(candidates))

    def shown(self, value):
        return list(value)

    def text(self, value):
        return ",".join(map(str, value))


class StepRange(Kind):
    """Training steps, counted from 1 at the first optimizer step: stored as ``(first, last)``, ``last``
    None for "to the end"; ``None`` is off. ``on_means``: what a plain switch word on reads as (COC_MEASURE's
    1 = every step), None where a number means a step (COC_TRACE_STEPS's 2 = step 2)."""

    off_words = FALSE_WORDS

    def __init__(self, allowed: str, on_means: tuple | None = None):
        super().__init__(allowed)
        self.on_means = on_means

    def parse(self, variable, text):
        word = text.strip().lower()
        if self.on_means is not None and word in TRUE_WORDS:
            return self.on_means
        if self.on_means is not None and word in FALSE_WORDS:
            return None
        first, dash, last = word.partition("-")
        if first.isdigit() and int(first) >= 1 and (not dash or not last or (last.isdigit() and int(last) >= int(first))):
            return int(first), (int(last) if last else None) if dash else int(first)
        raise ConfigError(variable, text, self.allowed)

    def accepts(self, value):
        if value is None:
            return True
        return (isinstance(value, tuple) and len(value) == 2 and is_int(value[0]) and value[0] >= 1
                and (value[1] is None or (is_int(value[1]) and value[1] >= value[0])))

    def shown(self, value):
        return None if value is None else self.text(value)

    def text(self, value):
        if value is None:
            return "0"
        if self.on_means is not None and value == self.on_means:
            return "1"
        first, last = value
        return f"{first}-" if last is None else str(first) if first == last else f"{first}-{last}"


class Percent(Kind):
    """An integer percent, 0 to 100."""

    def __init__(self, allowed: str):
        super().__init__(allowed)

    def parse(self, variable, text):
        word = text.strip().rstrip("%").strip()
        if word.isdigit() and int(word) <= 100:
            return int(word)
        raise ConfigError(variable, text, self.allowed)

    def accepts(self, value):
        return is_int(value) and 0 <= value <= 100
