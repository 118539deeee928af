"""The test suite's own guards (tests/conftest.py), run in a scratch project."""

from __future__ import annotations

import subprocess
from pathlib import Path

CONFTEST = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()


def _project(pytester, test_source: str, *, cuda: bool = False):
    tests = pytester.mkdir("tests")
    (tests / "conftest.py").write_text(CONFTEST.replace("torch.cuda.is_available()", str(cuda)))
    (tests / "test_it.py").write_text(test_source)
    subprocess.run(["git", "init", "-q", str(pytester.path)], check=True)
    return pytester.runpytest("-p", "no:cacheprovider", "-rs", str(tests))


def test_gpu_marked_tests_are_skipped_without_cuda_and_only_they(pytester):
    result = _project(
        pytester,
        """
import pytest

@pytest.mark.gpu
def test_needs_gpu():
    pass

def test_gpu_in_its_name():
    pass
""",
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs a CUDA device*"])


def test_a_test_writing_into_the_repository_fails_the_session(pytester):
    result = _project(
        pytester,
        """
from pathlib import Path

def test_writes():
    (Path(__file__).resolve().parents[1] / "lightning_logs_stray.txt").write_text("x")
""",
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*created files in the repository*lightning_logs_stray.txt*"])
