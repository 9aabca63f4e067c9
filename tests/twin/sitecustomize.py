"""The twin's one shim (`make test-twin` puts this folder first on PYTHONPATH): triton 3.6's CPU interpreter
on numpy 2.4 or newer.

The GPU image pins triton 3.6 (torch 2.11 requires it) beside numpy 2.5. On a GPU, triton compiles its
kernels and never runs this interpreter; on a CPU (the twin, TRITON_INTERPRET=1) the interpreter turns a
one-element array into an int with `int(array)`, which numpy 2.4 and newer refuse ("only 0-dimensional
arrays can be converted to Python scalars"), so every kernel with a scalar index fails. triton 3.7 fixed
it upstream by squeezing the array first (`int(self.handle.data.squeeze())`); this applies that same one
line to triton.runtime.interpreter as it is imported, so that labkit's kernels still run through triton
3.6's front end here. Nothing else is changed, and nothing is imported early.
"""
import importlib.abc
import importlib.util
import sys

TARGET = "triton.runtime.interpreter"


def _squeeze_index(module):
    original = module._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))   # triton 3.7's line

    module._patch_lang_tensor = _patch_lang_tensor


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds TARGET as the other finders do, and runs _squeeze_index on it once it has been executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(module_loader := spec.loader, "exec_module"):
            return spec
        exec_module = module_loader.exec_module

        def exec_and_fix(module):
            exec_module(module)
            if hasattr(module, "_patch_lang_tensor"):
                _squeeze_index(module)

        module_loader.exec_module = exec_and_fix
        return spec


sys.meta_path.insert(0, _AfterImport())
