"""Which tests run where: ``make test`` runs the newest megatron-core with every test, the older
releases with ``TEST_SCOPE=older-release``: the suites that touch Megatron's API there, without the
cases that only test coc-inject's own logic again (the make test budget)."""

import os

import pytest

OLDER_RELEASE = os.environ.get("TEST_SCOPE") == "older-release"
newest_only = pytest.mark.skipif(OLDER_RELEASE, reason="runs on the newest megatron-core only (make test budget)")
