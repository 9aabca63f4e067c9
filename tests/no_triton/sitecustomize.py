"""Hide triton (or the modules named in LABKIT_HIDDEN_MODULES) from this Python process, as on a machine
without them: macOS and Windows have no triton wheels; the GPU image has no IPython.

tests/test_without_triton.py (and tests/test_gpu_smoke.py, with LABKIT_HIDDEN_MODULES=IPython) put this
folder first on PYTHONPATH; Python imports `sitecustomize` at start-up, before any user code, and every
finder on `sys.meta_path` is then wrapped so that it does not see the hidden packages:
`importlib.util.find_spec("triton")` is None (what `lk.has("triton")` and torch's own probe,
`torch.utils._triton.has_triton_package`, ask) and `import triton` raises ModuleNotFoundError.
Everything else imports as before.
"""
import logging
import os
import sys

HIDDEN = tuple(filter(None, os.environ.get("LABKIT_HIDDEN_MODULES", "triton").split(",")))


class _Without:
    """A meta-path finder that sees everything its wrapped finder sees, except the hidden packages."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find_spec = getattr(self.finder, "find_spec", None)
        return find_spec(name, path, target) if find_spec else None

    def __getattr__(self, attribute):             # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attribute)


class _NotTheLaptopsWarning(logging.Filter):
    """torch.utils.flop_counter warns "triton not found; flop counting will not work for triton kernels"
    when torch is a CUDA build (torch.version.cuda set) and triton is missing. The machines this folder
    stands in for never print it: macOS's and PyPI's Windows torch are CPU builds, and a Linux CUDA torch
    requires triton. Only a CUDA torch told here that triton is gone (a Linux laptop's registry torch
    running tests/test_without_triton.py) would, so that one line, and nothing else, is dropped."""

    def filter(self, record):
        return "triton not found; flop counting" not in record.getMessage()


for name in HIDDEN:
    if name in sys.modules:
        raise ImportError(f"{name} was imported before sitecustomize could hide it")
sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
if "triton" in HIDDEN:
    logging.getLogger("torch.utils.flop_counter").addFilter(_NotTheLaptopsWarning())
