"""Hide triton from this Python process, as on a machine where it has no wheels (macOS, Windows).

tests/test_without_triton.py puts this folder first on PYTHONPATH; Python imports `sitecustomize` at
start-up, before any user code, and every finder on `sys.meta_path` is then wrapped so that it does not
see triton: `importlib.util.find_spec("triton")` is None (what `lk.has("triton")` and torch's own probe,
`torch.utils._triton.has_triton_package`, ask) and `import triton` raises ModuleNotFoundError.
Everything else imports as before.
"""
import sys

HIDDEN = "triton"


class _WithoutTriton:
    """A meta-path finder that sees everything its wrapped finder sees, except triton and its submodules."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == HIDDEN:
            return None
        find_spec = getattr(self.finder, "find_spec", None)
        return find_spec(name, path, target) if find_spec else None

    def __getattr__(self, attribute):             # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attribute)


if HIDDEN in sys.modules:
    raise ImportError(f"{HIDDEN} was imported before sitecustomize could hide it")
sys.meta_path[:] = [_WithoutTriton(finder) for finder in sys.meta_path]
