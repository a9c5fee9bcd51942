import pytest


def pytest_collection_modifyitems(config, items):
    if config.getoption("--kill-matrix"):
        return
    skip = pytest.mark.skip(reason="part of the full kill matrix: run with --kill-matrix")
    for item in items:
        if "full_matrix" in item.keywords:
            item.add_marker(skip)
