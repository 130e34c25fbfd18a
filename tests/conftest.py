import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter on the CPU (set before Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


# The files that take longest, first: `pytest -n 2 --dist loadgroup` hands whole files out in collection order, so
# one of these left for last would keep one process busy while the other waits (.ci/run).
LONGEST = (
    "test_families",
    "test_cli",
    "test_cli_families",
    "test_selftest",
    "test_recording",
    "test_view",
    "test_works_with",
    "test_notebook",
    "test_kandinsky5",
    "test_wheel",
    "test_plot",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    first = {name: n for n, name in enumerate(LONGEST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(LONGEST)))  # stable: each file's own order kept
    # One unit of work per file under `--dist loadgroup`, as `--dist loadfile` makes them (a file's module fixtures
    # built once), but tests/test_families.py's per family case: that file alone is about half the suite.
    for item in items:
        case = item.callspec.params.get("family") if hasattr(item, "callspec") else None
        split = item.path.stem == "test_families" and isinstance(case, str)
        item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}:{case}" if split else item.path.stem))
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


# -- the batch tool's tests (tests/test_cli.py, tests/test_cli_wan.py) -----------------------------------
@pytest.fixture(scope="module")
def forget_accelerate_state():
    """``cogattn.dump.main`` sets up accelerate's process state (a singleton); later test files start without it."""
    yield
    from accelerate import PartialState

    PartialState._reset_state()


@pytest.fixture
def dump(capsys, forget_accelerate_state):
    """``cogattn.dump.main(argv)`` in this process: its exit code, stdout and stderr."""
    from types import SimpleNamespace

    from cogattn.dump import main

    def run(*args, check=None):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        if check is not None:
            assert code == check, err[-3000:]
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny ops run
    10-20× slower on two threads of a shared CPU (spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
