"""Run inside the image by test_image_jit.py: what Triton's JIT needs at the first kernel launch
(a C compiler, Python's headers, Triton's bundled CUDA headers), then every import.

1. A small C extension through ``compile_module_from_src``, Triton's own path (cc, Python.h,
   dlopen), loaded and called.
2. Triton's real CUDA sources: ``driver.c`` (its ``cuda_utils``) and the launcher
   ``make_launcher`` generates for a kernel taking two fp32 pointers and an int, compiled with
   Triton's include dirs. Where the GPU driver's libcuda.so.1 is found (a GPU host) they are
   linked against it and loaded, exactly as at a first launch; without one (a build machine)
   they are compiled and linked with libcuda's symbols left unresolved, which checks every
   header and the compiler but not the load.
3. Every pin of the image's requirements.lock (``/opt/deepserve``, the working directory) is
   installed at its version: the same pins ``make setup`` and the GPU bundle install.
"""

import importlib
import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from triton.runtime.build import _build, compile_module_from_src

SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}
static PyMethodDef methods[] = {{"add", add, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "jit_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_jit_probe(void) { return PyModule_Create(&module); }
"""

probe = compile_module_from_src(SRC, "jit_probe")  # Triton's own path: cc, Python.h, dlopen
assert probe.add(2, 3) == 5

from triton.backends.nvidia import driver as nv  # noqa: E402

sources = {
    "cuda_utils": Path(nv.dirname, "driver.c").read_text(),
    "__triton_launcher": nv.make_launcher({}, {"x": "*fp32", "y": "*fp32", "n": "i32"}, None),
}
try:
    library_dirs = nv.library_dirs()  # asserts that libcuda.so.1 is found
except AssertionError:
    library_dirs = None
if library_dirs is not None:
    for name, src in sources.items():
        compile_module_from_src(src, name, library_dirs, nv.include_dirs, nv.libraries)
    launcher = "linked and loaded"
else:
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in sources.items():
            path = os.path.join(tmp, f"{name}.c")
            Path(path).write_text(src)
            _build(name, path, tmp, [nv.libdevice_dir], nv.include_dirs, [], [])
    launcher = "compiled (no libcuda.so.1)"

import torch  # noqa: E402
import triton  # noqa: E402

services = ("recipe", "entrypoint", "balancer", "prefill", "decode", "aggregated", "kvstore")
for name in services:
    importlib.import_module(f"services.{name}.main")
unlocked = []  # pins installed at another version, or not at all
for line in Path("requirements.lock").read_text().splitlines():
    if line and not line.startswith("#"):
        name, _, want = line.partition("==")
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "missing"
        if have != want:
            unlocked.append(f"{name} {have} (lock {want})")
print(
    json.dumps(
        {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": sys.version.split()[0],
            "services": len(services),
            "launcher": launcher,
            "unlocked": unlocked,
        }
    )
)
