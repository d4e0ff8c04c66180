"""The installed distribution serves the console: a wheel built from the sources, installed
into a fresh virtual environment, renders /admin/login and serves /static from its own copy
(not the checkout's)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("runtime", "console", "pallas_kernels", "templates")
MARKER = "<!-- served from the installed wheel -->"

pytestmark = pytest.mark.timeout(240)

SNIPPET = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import console, runtime
    from runtime.kernels.cpu import build as kernels
    from console.app import create_app
    from console.assets import static_dir, templates_dir
    from console.settings import ServerSettings
    from litestar.testing import TestClient

    app = create_app(ServerSettings(admin_token="t" * 32, warmup=False, access_log=False))
    with TestClient(app) as client:
        login = client.get("/admin/login")
        htmx = client.get("/static/htmx.min.js")
    print(json.dumps({"console": console.__file__, "runtime": runtime.__file__,
                      "templates": str(templates_dir()), "static": str(static_dir()),
                      "login_status": login.status_code, "login": login.text,
                      "htmx_status": htmx.status_code, "htmx_bytes": len(htmx.content),
                      "kernel_sources": [str(p) for p in (*kernels.SOURCES, *kernels.HEADERS) if p.is_file()],
                      "sys_path": sys.path}))
""")


def _copy_sources(dst: Path) -> None:
    """Build from a copy: setuptools' build/ in the checkout could hold stale modules."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for name in SOURCES:
        shutil.copytree(REPO / name, dst / name, ignore=ignore)


def _build_wheel(tmp: Path) -> Path:
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(dist)], check=True, timeout=120)
    wheels = list(dist.glob("pagedjax-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_every_module_template_and_static_file(tmp_path):
    names = set(zipfile.ZipFile(_build_wheel(tmp_path)).namelist())
    modules = {p.relative_to(REPO).as_posix() for pkg in ("runtime", "console", "pallas_kernels")
               for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    templates = {"console/" + p.relative_to(REPO).as_posix() for p in (REPO / "templates").rglob("*.html")}
    static = {p.relative_to(REPO).as_posix() for p in (REPO / "console" / "static").iterdir() if p.is_file()}
    assert modules and templates and static
    assert not modules - names, f"modules missing from the wheel (pyproject.toml packages): {modules - names}"
    assert not templates - names, f"templates missing from the wheel: {templates - names}"
    assert not static - names, f"static files missing from the wheel: {static - names}"
    kernels = {p.relative_to(REPO).as_posix() for ext in ("*.cc", "*.h")
               for p in (REPO / "runtime" / "kernels" / "cpu").glob(ext)}
    assert len(kernels) >= 5 and not kernels - names, f"C++ kernel sources missing from the wheel: {kernels - names}"
    assert not any(n.startswith(("tests/", "templates/")) for n in names)


def test_installed_wheel_serves_the_console(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=120)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies come from this interpreter's site-packages, listed as plain paths: the
    # .pth files in there (an editable pagedjax among them) are not run, and the fresh venv's
    # own site-packages, holding the wheel, comes first on sys.path.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_pagedjax_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    installed_login = site / "console" / "templates" / "admin" / "login.html"
    assert installed_login.is_file()
    text = installed_login.read_text()
    assert text.count("</form>") == 1
    installed_login.write_text(text.replace("</form>", "</form>" + MARKER))

    run_dir = tmp_path / "run"  # nothing importable here: the checkout is not on sys.path
    run_dir.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([str(py), "-c", SNIPPET], cwd=run_dir, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("console", "runtime", "templates", "static"):
        assert Path(r[key]).resolve().is_relative_to(site.resolve()), (key, r[key], r["sys_path"])
    assert r["login_status"] == 200
    assert '<form method="post" action="/admin/login">' in r["login"] and 'name="token"' in r["login"]
    assert MARKER in r["login"]  # rendered from the venv's copy of the template
    assert r["htmx_status"] == 200 and r["htmx_bytes"] == (REPO / "console/static/htmx.min.js").stat().st_size
    # the C++ kernels build from the installed copy's sources (runtime/kernels/cpu/build.py)
    from runtime.kernels.cpu import build as kernels

    n_sources = len(kernels.SOURCES) + len(kernels.HEADERS)
    assert len(r["kernel_sources"]) == n_sources and all(Path(p).resolve().is_relative_to(site.resolve())
                                                         for p in r["kernel_sources"]), r["kernel_sources"]
