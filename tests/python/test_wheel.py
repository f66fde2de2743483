"""The wheel: `pip wheel ./python` builds libepx with CMake through
scikit-build-core into a platform wheel that, installed into a fresh venv,
imports and runs with nothing copied by hand. Needs scikit-build-core and
CMake in the Python that runs it (make test's venv has them).
"""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_wheel_builds_installs_and_runs(tmp_path):
    """pip wheel ./python (scikit-build-core + CMake) gives a platform wheel
    with libepx inside; installed into a fresh venv it imports and runs a
    dispatch with nothing copied by hand (and no EPX_LIBRARY); MPI, where
    found at build time, is a plugin libepx loads at run time."""
    pytest.importorskip("scikit_build_core")
    env = dict(os.environ, SKBUILD_CMAKE_DEFINE="EPX_BUILD_CUDA=OFF")
    env.pop("EPX_LIBRARY", None)
    env.pop("PYTHONPATH", None)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                            "--no-deps", "-w", str(tmp_path / "dist"), str(REPO / "python")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("epx-*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install",
                              "--no-deps", "--no-index", str(wheel)]
                             if _pip_has_python_option() else
                             [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                              "--target", str(_site_packages(py)), str(wheel)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    code = ("import numpy as np, epx\n"
            "assert epx.library_path.startswith(%r), epx.library_path\n"
            "x = epx.empty((8, 16)); x[:] = 1\n"
            "r = epx.route(np.random.randn(8, 4).astype(np.float32), top_k=2)\n"
            "with epx.Comm.create_self() as c, \\\n"
            "        c.buffer(hidden=16, num_experts=4, max_top_k=2) as b:\n"
            "    h = b.dispatch_layout(r)\n"
            "    out = b.combine(h, b.dispatch(h, x) * 2)\n"
            "    h.release()\n"
            "print('ok', epx.has_mpi(), float(out.sum()))\n" % str(venv))
    run = subprocess.run([py, "-c", code], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "ok", run.stdout
    assert abs(float(run.stdout.split()[2]) - 2 * 8 * 16) < 1e-3, run.stdout
    _check_mpi_is_a_plugin(py, venv, env, tmp_path, run.stdout.split()[1] == "True")


def _check_mpi_is_a_plugin(py, venv, env, tmp_path, has_mpi):
    """libepx itself needs no libmpi; where the wheel was built with MPI, its
    plugin beside libepx gives epx.has_mpi(), and without the plugin (as on
    a machine without MPI) the MPI call says why."""
    (lib,) = venv.glob("lib/python*/site-packages/epx/libepx.so")
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "libmpi" not in needed, needed
    plugin = lib.parent / "libepx_mpi.so"
    assert has_mpi == plugin.exists(), (has_mpi, sorted(p.name for p in lib.parent.iterdir()))
    if not has_mpi:
        return
    plugin.rename(tmp_path / "libepx_mpi.so")
    code = ("import epx\n"
            "assert not epx.has_mpi()\n"
            "try:\n"
            "    epx.Comm.from_mpi(64)  # never read: the plugin is missing\n"
            "except epx.UnsupportedError as e: print('refused', 'plugin' in str(e))\n")
    run = subprocess.run([py, "-c", code], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split() == ["refused", "True"], run.stdout + run.stderr


def _pip_has_python_option():
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                         text=True).stdout.split()
    major, minor = (int(v) for v in out[1].split(".")[:2])
    return (major, minor) >= (22, 3)


def _site_packages(py):
    return subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _configure_wheel(tmp_path, python, *defines):
    """Configures python/CMakeLists.txt (no build) with `python` as the
    building Python; returns CMake's output."""
    run = subprocess.run(["cmake", "-S", str(REPO / "python"), "-B", str(tmp_path / "build"),
                          "-DPython_EXECUTABLE=%s" % python] + list(defines),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def test_wheel_cuda_backend_follows_the_building_torch(tmp_path):
    """Without EPX_BUILD_CUDA, the wheel has the CUDA backend only where the
    building Python's torch has CUDA and nvcc is of the same major version;
    a Python without torch (pip's isolated build) gives a CPU wheel."""
    if not shutil.which("cmake"):
        pytest.skip("needs cmake")
    fake = tmp_path / "python-with-cuda-99"
    fake.write_text("#!/bin/sh\necho 99.1\n")
    fake.chmod(0o755)
    out = _configure_wheel(tmp_path / "a", fake)
    assert "EPX_BUILD_CUDA=OFF (torch CUDA: '99.1')" in out, out[-2000:]
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc:
        assert "torch uses CUDA 99.1 but nvcc is CUDA" in out, out[-2000:]
    none = tmp_path / "python-without-torch"
    none.write_text("#!/bin/sh\nexit 1\n")
    none.chmod(0o755)
    assert "EPX_BUILD_CUDA=OFF (torch CUDA: '')" in _configure_wheel(tmp_path / "b", none)
    torch = pytest.importorskip("torch")
    if nvcc and torch.version.cuda:
        release = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        if "release %s." % torch.version.cuda.split(".")[0] in release:
            out = _configure_wheel(tmp_path / "c", sys.executable)
            assert "EPX_BUILD_CUDA=ON (torch CUDA: '%s')" % torch.version.cuda in out, out[-2000:]


def _toml(path):
    tomllib = pytest.importorskip("tomllib")
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_root_pyproject_builds_the_same_wheel(tmp_path):
    """`pip install .` at the repository root builds the wheel of
    python/pyproject.toml: the same project and build settings (the source
    and package paths one level down), and a wheel with libepx and every
    module of python/epx."""
    root, sub = _toml(REPO / "pyproject.toml"), _toml(REPO / "python" / "pyproject.toml")
    assert root["project"] == sub["project"] and root["build-system"] == sub["build-system"]
    moved = {"cmake": {**sub["tool"]["scikit-build"]["cmake"], "source-dir": "python"},
             "wheel": {**sub["tool"]["scikit-build"]["wheel"], "packages": ["python/epx"]}}
    want = {**sub["tool"]["scikit-build"], **moved}
    got = dict(root["tool"]["scikit-build"])
    got["sdist"], want["sdist"] = None, None
    assert got == want
    pytest.importorskip("scikit_build_core")
    env = dict(os.environ, SKBUILD_CMAKE_DEFINE="EPX_BUILD_CUDA=OFF")
    env.pop("EPX_LIBRARY", None)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                            "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("epx-*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(REPO / "python")) for p in (REPO / "python" / "epx").rglob("*.py")}
    assert "epx/libepx.so" in names and modules <= names, sorted(modules - names)
