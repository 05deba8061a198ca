"""The unit tier starts nothing: a test here that asks for a service fails, naming the tier it belongs in."""

import pytest


@pytest.fixture(scope="session")
def services():
    pytest.fail("a unit test starts nothing: a test that needs Kafka and Redis belongs in tests/kafka/")


@pytest.fixture(scope="session")
def redis_url():
    pytest.fail("a unit test starts nothing: a test that needs Redis belongs in tests/redis/")
