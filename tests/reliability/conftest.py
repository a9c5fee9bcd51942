import pytest

# each full matrix runs under its own option; the fast subsets always run
MATRICES = {"full_matrix": ("--kill-matrix", "kill"), "full_tamper_matrix": ("--tamper-matrix", "tampering")}


def pytest_collection_modifyitems(config, items):
    for marker, (option, name) in MATRICES.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"part of the full {name} matrix: run with {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
