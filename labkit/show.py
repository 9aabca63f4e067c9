"""Show the code a notebook teaches: `lk.show(fn)`, syntax-highlighted, only the lines the lesson needs.

    lk.show(zero.DDP.local_grad)                      # one function, method or class, whole
    lk.show(HostAdam.step, start="for p", end="copy_") # from the first line containing `start` to the first
                                                      # line after it containing `end` (both shown)
    lk.show(BlockAllocator.allocate, BlockAllocator.free)  # several, one after another

It replaces `Code(inspect.getsource(...))` chains in the notebooks: the code shown is the code that runs.
"""
import inspect
import textwrap

__all__ = ["show", "source"]


def source(obj, start=None, end=None):
    """The source of `obj` (function, method, class or module), dedented; with `start`/`end`, only the lines
    from the first containing `start` to the first after it containing `end`, both included."""
    target = getattr(obj, "fn", obj)  # a @triton.jit kernel keeps its Python function in .fn
    try:
        text = textwrap.dedent(inspect.getsource(target))
    except (TypeError, OSError) as e:
        raise TypeError(f"show: obj={obj!r} has no Python source to show ({e})") from None
    if start is None and end is None:
        return text.rstrip("\n")
    lines = text.splitlines()
    first = 0
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), None)
        if first is None:
            raise ValueError(f"show: start={start!r} is on no line of {_name(obj)}")
    last = len(lines) - 1
    if end is not None:
        last = next((i for i in range(first, len(lines)) if end in lines[i]), None)
        if last is None:
            raise ValueError(f"show: end={end!r} is on no line of {_name(obj)} after start={start!r}")
    return textwrap.dedent("\n".join(lines[first:last + 1]))


def show(*objs, start=None, end=None):
    """Display the source of each of `objs` (see `source`) as highlighted Python; returns the display object,
    so a notebook cell ending in `lk.show(...)` shows it (and plain text where IPython is absent)."""
    if not objs:
        raise TypeError("show: name at least one function, method, class or module to show")
    text = "\n\n".join(source(obj, start, end) for obj in objs)
    try:
        from IPython.display import Code
    except ImportError:
        return _Plain(text)
    return Code(text, language="python")


class _Plain(str):
    def __repr__(self):
        return str(self)


def _name(obj):
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
