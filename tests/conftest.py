"""Shared test setup: the tests folder is importable (job functions travel to spawned ranks)."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def seed():
    """Fresh random data every run; printed so a failure can be replayed with RTP_TEST_SEED."""
    value = int(os.environ.get("RTP_TEST_SEED", random.randrange(1_000_000)))
    print(f"RTP_TEST_SEED={value}")
    return value
