from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.server import TritonProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    """The checked-in model repository, as-is, served by the real tritonserver on free ports."""
    proc = TritonProcess(tmp_path_factory.mktemp("triton")).start()
    yield proc
    proc.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
