"""What a user installs: the distribution's name, its license, and complete archives.

The distribution is ``outbound-dispatcher``; the import name is ``outbound``.
The name ``outbound`` on the package index is someone else's project, so
no install hint may lead there.

The archives: with ``OUTBOUND_TEST_DIST`` naming a folder that holds an
sdist and a wheel (``.ci/run`` sets it for the run that tests them), those
are checked; otherwise, in a git checkout with ``build`` and setuptools
installed (the ``dev`` extra), the test builds both from the checked-in
files, the wheel from the sdist as pip does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "outbound-dispatcher"
TIMEOUT = 120.0

#: What the sdist must carry beyond the package: everything needed to test
#: and to read about a release.
SDIST_DIRS = ("outbound", "tests", "examples", "benchmarks")
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "setup.cfg", "MANIFEST.in")
#: A few files that must be there even when the source tree cannot be listed.
SDIST_MUST = (
    "tests/conftest.py",
    "tests/outbox/conftest.py",
    "tests/contrib/django_project/settings.py",
    "examples/containers/run.py",
    "examples/flask_bot/app.py",
    "benchmarks/bench_dispatch.py",
)

# An install line or extra that names the taken distribution "outbound":
# ``pip install outbound``, ``'outbound[flask]'``, ``outbound[test]``.
_TAKEN = re.compile(
    r"pip install\s+(?:-\S+\s+)*['\"]?outbound(?![\w.-])|(?<![\w./-])outbound\[[\w,-]+\]"
)


def test_metadata_names_the_distribution_and_its_license() -> None:
    meta = importlib.metadata.metadata(DIST)
    assert meta["Name"] == DIST
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta.get_all("Project-URL")
    assert DIST in importlib.metadata.packages_distributions()["outbound"]
    for extra in ("postgres", "flask", "flask-sqlalchemy", "django", "test"):
        assert extra in (meta.get_all("Provides-Extra") or [])
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")


def test_no_install_hint_leads_to_the_taken_name() -> None:
    texts = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "CHANGELOG.md"]
    for folder in SDIST_DIRS:
        texts += (ROOT / folder).rglob("*.py")
        texts += (ROOT / folder).rglob("*.md")
    found = []
    for path in texts:
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _TAKEN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "install hints naming the taken distribution 'outbound':\n" + "\n".join(found)
    assert _TAKEN.search("pip install 'outbound" + "[flask]'")  # the check can fail
    assert _TAKEN.search("pip install outbound" + "\n")
    assert not _TAKEN.search("pip install 'outbound-dispatcher[flask]'")


def test_the_readme_says_both_names_first() -> None:
    head = (ROOT / "README.md").read_text(encoding="utf-8")[:600]
    assert f"pip install {DIST}" in head
    assert "import outbound" in head


def _source_files() -> list[str] | None:
    """The checkout's files (tracked, or new and not ignored); None outside a git checkout."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        timeout=TIMEOUT,
        check=True,
    )
    return [name for name in listed.stdout.decode().split("\0") if (ROOT / name).is_file()]


def _archives(tmp_path: Path, sources: list[str] | None) -> tuple[Path, Path]:
    given = os.environ.get("OUTBOUND_TEST_DIST")
    if given:
        folder = Path(given)
    else:
        if sources is None:
            pytest.skip("not a git checkout and OUTBOUND_TEST_DIST is not set: nothing to build")
        if not _runnable("build", tmp_path / "scratch"):
            pytest.skip("the 'build' package is not installed (the dev extra has it)")
        # A copy of the checked-in files, so nothing local leaks in.
        src = tmp_path / "src"
        for name in sources:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
        folder = tmp_path / "dist"
        done = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(folder), str(src)],
            cwd=tmp_path,  # not the checkout: a leftover build/ there would shadow the tool
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        if done.returncode != 0 and "Backend" in done.stderr and "setuptools" in done.stderr:
            pytest.skip(f"cannot build without isolation here: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stdout + done.stderr
    return _pick(folder)


def _pick(folder: Path) -> tuple[Path, Path]:
    """The sdist and the wheel of the installed version in ``folder`` (which may hold older
    ones): a clear failure if either is missing."""
    version = importlib.metadata.version(DIST)
    sdists = list(folder.glob(f"outbound_dispatcher-{version}.tar.gz"))
    wheels = list(folder.glob(f"outbound_dispatcher-{version}-*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        found = sorted(p.name for p in folder.glob("outbound_dispatcher-*"))
        pytest.fail(
            f"{folder} must hold one sdist and one wheel of version {version}; it holds {found}"
        )
    return sdists[0], wheels[0]


def _runnable(module: str, cwd: Path) -> bool:
    """True if ``python -m module`` runs a real tool from ``cwd``.

    ``importlib.util.find_spec("build")`` is fooled by a leftover
    ``build/`` directory of the checkout (what ``pip install .`` and
    ``python -m build`` leave): the current directory is on ``sys.path``,
    and that directory is found as a namespace package.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}.__main__"],
        cwd=cwd,
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    return done.returncode == 0


def test_a_leftover_build_folder_is_not_taken_for_the_build_tool(tmp_path: Path) -> None:
    """``pip install .`` leaves ``build/`` (ignored by git) in the checkout."""
    checkout = tmp_path / "checkout"
    (checkout / "build" / "lib" / "outbound").mkdir(parents=True)
    (checkout / "build" / "lib" / "outbound" / "__init__.py").write_text("STALE = True\n")
    assert _runnable("build", checkout) == _runnable("build", tmp_path / "empty")
    # The same with a name no tool has: the folder alone is not a tool.
    (checkout / "no_such_tool_here").mkdir()
    assert not _runnable("no_such_tool_here", checkout)
    assert _runnable("pytest", checkout)  # the check can say yes


def test_stale_archives_beside_the_current_ones_are_not_tested(tmp_path: Path) -> None:
    version = importlib.metadata.version(DIST)
    for name in (
        "outbound_dispatcher-0.0.1.tar.gz",
        "outbound_dispatcher-0.0.1-py3-none-any.whl",
        f"outbound_dispatcher-{version}.tar.gz",
        f"outbound_dispatcher-{version}-py3-none-any.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    sdist, wheel = _pick(tmp_path)
    assert (sdist.name, wheel.name) == (
        f"outbound_dispatcher-{version}.tar.gz",
        f"outbound_dispatcher-{version}-py3-none-any.whl",
    )


def test_sdist_and_wheel_are_complete(tmp_path: Path) -> None:
    sources = _source_files()
    sdist, wheel = _archives(tmp_path, sources)

    with tarfile.open(sdist) as tar:
        top, *_ = tar.getnames()[0].split("/")
        in_sdist = {name.partition("/")[2] for name in tar.getnames()}
    expected = set(SDIST_FILES) | set(SDIST_MUST)
    if sources is not None and not os.environ.get("OUTBOUND_TEST_DIST"):
        expected |= {name for name in sources if name.split("/")[0] in SDIST_DIRS}
    missing = sorted(expected - in_sdist)
    assert not missing, f"missing from {sdist.name}: {missing}"
    assert not [name for name in in_sdist if "__pycache__" in name or name.endswith(".pyc")]

    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        (metadata,) = [n for n in in_wheel if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    info = metadata.rpartition("/")[0]
    assert f"{info}/licenses/LICENSE" in in_wheel
    assert "outbound/py.typed" in in_wheel
    assert "outbound/contrib/django/templates/admin/outbound/outboxrow/confirm.html" in in_wheel
    package = {n for n in in_sdist if n.startswith("outbound/") and n.endswith(".py")}
    assert package <= in_wheel, sorted(package - in_wheel)
    assert not [n for n in in_wheel if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert f"Name: {DIST}\n" in meta
    assert "License-Expression: MIT\n" in meta
    assert top.startswith("outbound_dispatcher-")
