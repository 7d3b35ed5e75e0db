"""coc-inject interpreter bootstrap: on PYTHONPATH via ``source env/coc.sh`` or ``coc-inject run``.

It runs at the start of every Python process that sees it, and where no ``__pycache__`` can be
written here (read-only checkout, PYTHONDONTWRITEBYTECODE) it is compiled at every start, so it
stays small: import ``coc_inject.bootstrap`` (stdlib-only, lazy; its byte code kept in a per-user
cache in that case), chain the ``sitecustomize`` this one shadows, call ``bootstrap.start()``.
No fault in here may break an unrelated program: everything is caught and reported in one line.
"""

import os
import sys


def _chain():
    """Import the next ``sitecustomize`` on sys.path, the one this module shadows."""
    ours = sys.modules.get(__name__)
    # site.py has made sys.path entries absolute. Our directory may be listed more than once;
    # listed under another name (a symlink), the "other" sitecustomize found is this file
    # again, which chains in turn (start() is idempotent).
    here = os.path.dirname(os.path.abspath(__file__))
    removed = []
    for index, entry in enumerate(sys.path):
        try:
            if isinstance(entry, str) and os.path.abspath(entry or ".") == here:
                removed.append((index, entry))
        except (TypeError, ValueError, OSError):  # junk in sys.path is not our business
            pass
    if not removed:
        return
    for index, _ in reversed(removed):
        del sys.path[index]
    sys.modules.pop(__name__, None)
    try:
        try:
            import sitecustomize  # noqa: F401  (the shadowed one; it may chain further)
        except ImportError as exc:
            if exc.name != __name__:  # an import *inside* the other sitecustomize failed
                raise
    except Exception as err:  # reported the way CPython's site.py reports it
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (err.__class__.__name__, err))
    finally:
        # sys.path as the user set it (plus what the other one added); if another
        # sitecustomize ran, it is "the" sitecustomize, as it would be without us.
        for index, entry in removed:
            sys.path.insert(index, entry)
        if __name__ not in sys.modules and ours is not None:
            sys.modules[__name__] = ours


def _cache_dir(package):
    """The per-user directory for the byte code of ``package``'s __init__ and bootstrap when
    Python will not keep it in their ``__pycache__``: missing there, and PYTHONDONTWRITEBYTECODE
    set or the directory read-only. Else None, and also when the interpreter keeps no byte code,
    PYTHONPYCACHEPREFIX already says where it goes, or COC_CACHE_DIR is relative (``off``)."""
    tag = sys.implementation.cache_tag
    if tag is None or sys.pycache_prefix is not None:
        return None
    if sys.flags.optimize:
        tag += ".opt-%d" % sys.flags.optimize
    pycache = os.path.join(package, "__pycache__")
    if os.path.isfile(os.path.join(pycache, "bootstrap.%s.pyc" % tag)) and os.path.isfile(
            os.path.join(pycache, "__init__.%s.pyc" % tag)):
        return None
    if not sys.dont_write_bytecode and os.access(pycache if os.path.isdir(pycache) else package, os.W_OK):
        return None  # Python writes them at this start
    env = os.environ
    base = env.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # unset or relative: ignored, as the XDG spec says
        base = os.path.join(env.get("HOME") or "", ".cache")
    cache = env.get("COC_CACHE_DIR") or os.path.join(base, "coc-inject", "pycache")
    return cache if os.path.isabs(cache) else None  # no HOME, or COC_CACHE_DIR=off


def _import_bootstrap():
    """Return ``coc_inject.bootstrap``, preferring the copy of coc_inject this file ships with.

    Layouts: a checkout ``<root>/sitecustomize/sitecustomize.py`` next to ``<root>/coc_inject/``;
    an installed ``coc_inject/_site/sitecustomize.py`` (what ``coc-inject run`` uses, possibly
    for another interpreter). Else the normal import. ``<root>`` is on sys.path only during
    this import (a checkout's tests/, examples/ must not shadow other packages); where its
    ``__pycache__`` cannot be used, the byte code goes to the per-user cache (``_cache_dir``)
    with pycache_prefix / dont_write_bytecode changed for this import only. importlib checks
    that cached byte code against the source's mtime and size, and silently compiles from
    source when the cache cannot be written.
    """
    if "coc_inject" not in sys.modules:
        parent = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        for package in (os.path.join(parent, "coc_inject"), parent):  # checkout, installed
            if os.path.basename(package) == "coc_inject" and os.path.isfile(
                    os.path.join(package, "__init__.py")):
                break
        else:
            package = None
        if package is not None:
            root = os.path.dirname(package)
            saved = sys.pycache_prefix, sys.dont_write_bytecode
            sys.path.insert(0, root)
            try:
                cache = _cache_dir(package)
                if cache:
                    sys.pycache_prefix, sys.dont_write_bytecode = cache, False
                import coc_inject.bootstrap  # noqa: F401
            finally:
                sys.pycache_prefix, sys.dont_write_bytecode = saved
                try:
                    sys.path.remove(root)
                except ValueError:
                    pass
    import coc_inject.bootstrap

    return coc_inject.bootstrap


def _main():
    # Load our package, chain, then start: the copy of coc_inject first on PYTHONPATH wins when
    # two bootstraps are listed (the chained one finds it in sys.modules), and the chained
    # sitecustomize can still set variables.
    bootstrap = failure = None
    try:
        bootstrap = _import_bootstrap()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # never break an unrelated program
        failure = err
    try:
        _chain()
    except Exception as err:  # defensive: a bug in the chaining must not stop the interpreter
        try:
            sys.stderr.write("[coc-inject] could not chain the shadowed sitecustomize: %r\n" % (err,))
        except Exception:
            pass
    if isinstance(failure, ImportError) and failure.name in ("coc_inject", "coc_inject.bootstrap"):
        failure = None  # not found: maybe the chained sitecustomize (or a second bootstrap) provided it
    try:
        if failure is None:
            (bootstrap or _import_bootstrap()).start()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # never break an unrelated program
        failure = err
    if failure is not None:
        try:
            sys.stderr.write("[coc-inject] bootstrap failed, CoC is NOT active: %s\n"
                             % " ".join(("%s: %s" % (failure.__class__.__name__, failure)).split()))
        except Exception:
            pass


_main()
del _chain, _cache_dir, _import_bootstrap, _main
