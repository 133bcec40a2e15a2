"""The source files of the functions ``ringtrain.run`` sends by value, put back on the ranks.

cloudpickle (3.1.2 and later) writes ``<dynamic-code>`` as the file of every function it pickles
by value, so that a payload does not depend on where it was made. A rank's traceback then gives
the lines of the user's function by number only, with neither its file nor its text. The
launcher sends the files along (:func:`files_of`) and the rank puts them back (:func:`restore`)
before it calls the function; where the file exists on the rank's host, the traceback quotes its
lines too.
"""

from __future__ import annotations

from types import CodeType, FunctionType

DYNAMIC = "<dynamic-code>"


def files_of(func: object) -> dict[str, str]:
    """``{qualified name: file}`` of ``func`` and of the functions of its module that it names
    (which travel with it)."""
    if not isinstance(func, FunctionType):
        return {}
    out = {func.__qualname__: func.__code__.co_filename}
    for name in _names(func.__code__):
        value = func.__globals__.get(name)
        if isinstance(value, FunctionType) and value.__module__ == func.__module__:
            out[value.__qualname__] = value.__code__.co_filename
    return out


def restore(func: object, files: dict[str, str]) -> None:
    """Put ``files`` back into ``func`` and the functions its globals hold, where cloudpickle
    wrote ``<dynamic-code>`` (a function pickled by reference keeps its own file)."""
    if not isinstance(func, FunctionType):
        return
    named = (v for v in func.__globals__.values() if isinstance(v, FunctionType))
    for f in (func, *named):
        file = files.get(f.__qualname__)
        if file and f.__code__.co_filename == DYNAMIC:
            f.__code__ = _renamed(f.__code__, file)


def _names(code: CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it (lambdas, inner functions) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _renamed(code: CodeType, file: str) -> CodeType:
    consts = tuple(_renamed(c, file) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=file, co_consts=consts)
