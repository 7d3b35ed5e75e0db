import pytest

from dist_harness import RankPool


@pytest.fixture(scope="module")
def pool2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool3():
    pool = RankPool(3)
    yield pool
    pool.close()
