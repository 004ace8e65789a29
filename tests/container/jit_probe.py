"""Run inside the image by test_image_jit.py: what Triton's JIT needs at the first kernel launch
(a C compiler, Python's headers), then every import."""

import importlib
import json
import sys

from triton.runtime.build import compile_module_from_src

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
import torch  # noqa: E402
import triton  # noqa: E402

services = ("recipe", "entrypoint", "balancer", "prefill", "decode", "aggregated", "kvstore")
for name in services:
    importlib.import_module(f"services.{name}.main")
print(
    json.dumps(
        {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": sys.version.split()[0],
            "services": len(services),
        }
    )
)
