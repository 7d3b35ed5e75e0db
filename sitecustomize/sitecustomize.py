"""coc-inject interpreter bootstrap (put this directory on PYTHONPATH: ``source env/coc.sh``).

Runs at the start of every Python process that sees it, so it stays tiny and stdlib-only:
1. import ``coc_inject.bootstrap`` (stdlib-only, lazy);
2. chain the ``sitecustomize`` that this one shadows (the venv's / distro's), as if we were
   not there;
3. call ``coc_inject.bootstrap.start()``, which does nothing unless CoC is requested and
   even then only arms a lazy trigger for the first ``import megatron``.
No fault in here may break an unrelated program: everything is caught and reported in one line.
"""

import os
import sys


def _chain():
    """Import the next ``sitecustomize`` on sys.path, the one this module shadows."""
    ours = sys.modules.get(__name__)
    # site.py has made sys.path entries absolute and __file__ is "<entry>/sitecustomize.py",
    # so plain string compares suffice. If the directory is also listed under another name
    # (a symlink), the "other" sitecustomize found is this file again: that copy chains in
    # turn, dropping its own entry, and start() is idempotent.
    here = os.path.dirname(os.path.abspath(__file__))
    removed = []  # (index, entry): our directory may be listed more than once
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
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                "%s: %s\n" % (err.__class__.__name__, err)
            )
    finally:
        # Put our directory back where it was (after whatever the other one added), so
        # sys.path looks as the user set it. If no other sitecustomize was found (or it
        # failed), we are "the" sitecustomize again; if one was found, it is, as it would
        # be without us.
        for index, entry in removed:
            sys.path.insert(index, entry)
        if __name__ not in sys.modules and ours is not None:
            sys.modules[__name__] = ours


def _import_bootstrap():
    """Return ``coc_inject.bootstrap``, preferring the copy of coc_inject this file ships with.

    Layouts: a source checkout ``<root>/sitecustomize/sitecustomize.py`` next to
    ``<root>/coc_inject/``; an installed copy ``<site-packages>/coc_inject/_site/sitecustomize.py``
    (what ``coc-inject run`` puts on PYTHONPATH, possibly for another interpreter). The
    bootstrap you put on PYTHONPATH should run the code it ships with, not some other copy
    that happens to be importable. But its directory must not stay on sys.path: a checkout's
    ``tests``, ``benchmarks``, ``examples`` would shadow other packages in every program. So
    that directory is on sys.path only for the duration of ``import coc_inject`` (which is
    cheap and lazy); the package then finds its submodules through its own ``__path__``.
    If neither layout matches, the normal import is used.
    """
    if "coc_inject" not in sys.modules:
        parent = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        if os.path.isfile(os.path.join(parent, "coc_inject", "__init__.py")):
            root = parent  # source checkout (or editable install)
        elif os.path.basename(parent) == "coc_inject" and os.path.isfile(
            os.path.join(parent, "__init__.py")
        ):
            root = os.path.dirname(parent)  # installed package: coc_inject/_site/
        else:
            root = None
        if root is not None:
            sys.path.insert(0, root)
            try:
                import coc_inject  # noqa: F401
            finally:
                try:
                    sys.path.remove(root)
                except ValueError:
                    pass
    import coc_inject.bootstrap

    return coc_inject.bootstrap


def _report(err):
    message = " ".join(("%s: %s" % (err.__class__.__name__, err)).split())
    try:
        sys.stderr.write("[coc-inject] bootstrap failed, CoC is NOT active: %s\n" % message)
    except Exception:
        pass


def _main():
    # Order: load our package, chain, then start. Loading first makes the copy of coc_inject
    # that comes first on PYTHONPATH win when two bootstraps are listed (the chained one
    # finds it in sys.modules); starting last lets the chained sitecustomize set variables.
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
        try:  # not found: maybe the chained sitecustomize (or a second bootstrap) provided it
            bootstrap, failure = _import_bootstrap(), None
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            failure = err
    if failure is not None:
        _report(failure)
        return
    try:
        bootstrap.start()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # never break an unrelated program
        _report(err)


_main()
del _chain, _import_bootstrap, _report, _main
