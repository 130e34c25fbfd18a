"""cogattn as users install it: a built wheel's contents, an editable install in a fresh virtual environment,
run from a folder outside the checkout, and ``scripts/dump_maps.py`` from a checkout with nothing installed. (The
installed wheel itself runs in .ci/run's plain stage: ``cogattn-dump`` and the self-test, from a folder outside the
checkout, with nothing but the wheel's dependencies.)

The fresh environments do not reinstall torch & co.: a ``.pth`` file adds this interpreter's
site-packages after their own (``.pth`` files inside an added folder are not processed, so the editable
install of cogattn there stays inactive), and cogattn alone is installed with ``pip --no-deps``. Slow:
each check starts Python processes that import torch and diffusers.
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = ("*.yaml", "prompts/*.txt", "prompts/*.jsonl", "prompts/images/*.png")  # pyproject's package-data


def _setuptools_builds() -> bool:
    """Whether this environment's setuptools builds cogattn (pyproject's build-system needs >= 77)."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    except importlib.metadata.PackageNotFoundError:
        return False


def _source_copy(dest: Path) -> Path:
    """The checkout without its environments and build outputs (builds then leave the checkout alone)."""
    anywhere = shutil.ignore_patterns(".git", ".venv*", "*.egg-info", "__pycache__", ".pytest_cache")
    top = {"build", "dist", "runs"}  # the checkout's own folders only: cogattn/runs is a package

    def skip(folder, names):
        return anywhere(folder, names) | (top & set(names) if Path(folder) == ROOT else set())

    return Path(shutil.copytree(ROOT, dest, ignore=skip))


def _run(*cmd, cwd=None, check=True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _fresh_venv(path: Path, *wheels: Path) -> tuple[Path, Path]:
    """A virtual environment with ``wheels`` installed (no dependencies) that sees this interpreter's
    site-packages after its own; returns its python and its site-packages."""
    venv.create(path, with_pip=False, symlinks=True)
    python = path / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    if wheels:  # this interpreter's pip, run by the fresh python (pip --python), installs into the fresh one
        _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", *wheels)
    (site / "_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    isolation = ["--no-build-isolation"] if _setuptools_builds() else []  # else pip fetches setuptools
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", tmp / "dist", src)
    (built,) = (tmp / "dist").glob("cogattn-*.whl")
    return built


def test_the_wheel_holds_every_package_and_the_shipped_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "cogattn").rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    configs = sorted(
        {f.relative_to(ROOT / "configs").as_posix() for g in CONFIG_FILES for f in (ROOT / "configs").glob(g)}
    )
    assert "tiny.yaml" in configs and "prompts/images/gradient.png" in configs
    assert [c for c in configs if f"cogattn/dump/configs/{c}" not in names] == []
    assert not [n for n in names if n.startswith("configs/")]  # inside the package, not beside it
    (license,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]  # pyproject's license-files
    assert "Apache License" in zipfile.ZipFile(wheel).read(license).decode()
    # the console script (.ci/run's plain stage runs it from the installed wheel alone, outside the checkout)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode().split("[console_scripts]")[1].split("[")[0]
    assert "cogattn-dump = cogattn.dump:main" in scripts.splitlines()


@pytest.mark.skipif(not _setuptools_builds(), reason="builds with this environment's setuptools (>= 77)")
def test_editable_install_maps_the_configs_folder(tmp_path):
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    name = _run(sys.executable, "-c", build, dist, cwd=src).stdout.strip().splitlines()[-1]
    python, _ = _fresh_venv(tmp_path / "env", dist / name)
    work = tmp_path / "work"
    work.mkdir()
    code = "import importlib.resources as r; print(r.files('cogattn.dump.configs')); from cogattn.dump.cli import main; main(['--dry-run'])"
    files, dry = _run(python, "-c", code, cwd=work).stdout.splitlines()[:2]
    assert Path(files) == src / "configs"
    assert dry == f"config {src / 'configs' / 'tiny.yaml'}"


def test_the_script_runs_from_a_checkout_with_nothing_installed(tmp_path):
    python, _ = _fresh_venv(tmp_path / "env")
    work = tmp_path / "work"
    work.mkdir()
    dry = _run(python, ROOT / "scripts" / "dump_maps.py", "--dry-run", cwd=work)
    assert dry.stdout.splitlines()[0] == f"config {ROOT / 'configs' / 'tiny.yaml'}"
    assert "predicted peak extra memory" in dry.stdout and list(work.iterdir()) == []
