"""Linear mixers registered from outside the package, as a user's own package would register them: each module
here declares its ops and its mixer and registers them on import; importing this package (tests/conftest.py at
collection, tests/helpers.py in the processes the distributed tests start) imports them all, and every proof of
the registered mixers runs for them (tests/helpers.py ``linear_families``)."""

from tests.mixers import gla  # noqa: F401
