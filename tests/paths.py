"""Where the tests find the repository, the test helpers and the client scripts."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SCRIPTS = TESTS / "scripts"
