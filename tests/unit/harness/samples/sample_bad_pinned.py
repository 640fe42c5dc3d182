import pytest


@pytest.mark.pinned_numerics
def test_pinned_in_the_pytest_process():
    pass
