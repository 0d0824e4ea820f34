"""How many examples a property test draws (tests/conftest.py loads the profiles)."""

from __future__ import annotations

from hypothesis import settings

DEFAULT_EXAMPLES = 100
"""hypothesis' own max_examples, which the default profile keeps."""


def examples(n: int) -> int:
    """A test's own count of examples, scaled by the loaded profile's max_examples over
    hypothesis' default: as many under the default profile, 3x under
    `pytest --hypothesis-profile=explore` (a count given to @settings overrides the profile's
    own). Read when the test module is collected, after the profile is loaded."""
    return max(1, n * settings().max_examples // DEFAULT_EXAMPLES)
