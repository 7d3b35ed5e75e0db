"""Which megatron-core release a job runs, and whether coc-inject patches it.

The version is the one of the ``megatron.core`` *module*: ``megatron.core.package_info.__version__``
(every release 0.12 ... 0.19 and main have it), not the installed distribution's metadata. A
Megatron-LM checkout on ``sys.path`` has no distribution, or shadows one of another release.
Distribution metadata is the fallback only where the module has no version and that distribution
is the one that installed the module found.

Stdlib only, and nothing here imports ``megatron.core`` itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

MODULE = "megatron.core"
INFO_MODULE = "megatron.core.package_info"
DISTRIBUTION = "megatron-core"

# Oldest and newest megatron-core minor release this version is tested against (Makefile, CI).
TESTED_MEGATRON = ((0, 12), (0, 19))
TESTED = "tested"
UNTESTED = "untested"  # outside the tested range or unknown, patched because COC_ALLOW_UNTESTED_MEGATRON=1
UNSUPPORTED = "unsupported"  # outside the tested range: left unpatched
UNKNOWN = "unknown"  # the release cannot be determined: left unpatched


@dataclass(frozen=True)
class Megatron:
    """One ``megatron.core``: its version (None: unknown), directory and where it comes from."""

    version: str | None
    core_dir: str | None
    distribution: str | None = None  # "megatron-core 0.19.2" when an installed distribution owns core_dir
    shadowed: str | None = None  # an installed megatron-core distribution elsewhere, which this one hides

    def origin(self) -> str:
        """Where it comes from: "directory ..." or "the installed distribution ..."."""
        if self.core_dir is None:
            return "an unknown location"
        root = os.path.dirname(os.path.dirname(self.core_dir))
        if self.distribution is not None:
            return f"the installed distribution {self.distribution} in {root}"
        return f"directory {root}" + (f", shadowing the installed {self.shadowed}" if self.shadowed else "")

    def unknown_why(self) -> str:
        """Why the release is unknown (only meaningful when release(self.version) is None)."""
        if self.version:
            return f"megatron.core.package_info.__version__ is {self.version!r}, not a release number"
        return (f"megatron.core.package_info.__version__ is missing, and no installed {DISTRIBUTION} "
                f"distribution owns {self.core_dir}")


def support_warning(megatron: Megatron, decision: str) -> str | None:
    """The one warning for a support decision (None for TESTED): names the version, where that
    megatron.core comes from, the tested range and COC_ALLOW_UNTESTED_MEGATRON."""
    if release(megatron.version) is not None:
        what = f"megatron-core {megatron.version} from {megatron.origin()} is outside the tested range {tested_range()}"
    else:
        what = f"the release of megatron.core from {megatron.origin()} cannot be determined ({megatron.unknown_why()})"
    if decision in (UNSUPPORTED, UNKNOWN):
        return f"CoC NOT applied: {what}; set COC_ALLOW_UNTESTED_MEGATRON=1 to try it anyway"
    if decision == UNTESTED:
        return f"{what}: CoC is applied UNTESTED (COC_ALLOW_UNTESTED_MEGATRON=1); compare a few steps with CoC off"
    return None


def imported() -> Megatron:
    """The ``megatron.core`` imported in this process (the post-import hook's, the report's)."""
    core = sys.modules.get(MODULE)
    core_dir = _package_dir(core)
    version = _module_version(core)
    return _with_origin(version, core_dir)


def importable() -> Megatron | None:
    """The ``megatron.core`` that ``import megatron.core`` would load from the current sys.path
    (``coc-inject status``), read without importing it: its ``package_info.py`` runs alone. None
    when there is none."""
    if sys.modules.get(MODULE) is not None:
        return imported()
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    core_dir = os.path.abspath(list(spec.submodule_search_locations)[0])
    return _with_origin(_read_package_info(core_dir), core_dir)


def release(version: str | None) -> tuple | None:
    """(major, minor) of a version string, or None when it does not parse."""
    try:
        major_minor = tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        return None
    return major_minor if len(major_minor) == 2 else None


def support(version: str | None, allow_untested: bool) -> str:
    """TESTED, UNTESTED (opted in), UNSUPPORTED or UNKNOWN: whether the layers get patched, and why."""
    major_minor = release(version)
    if major_minor is not None and TESTED_MEGATRON[0] <= major_minor <= TESTED_MEGATRON[1]:
        return TESTED
    if allow_untested:
        return UNTESTED
    return UNKNOWN if major_minor is None else UNSUPPORTED


def tested_range() -> str:
    low, high = (".".join(map(str, v)) for v in TESTED_MEGATRON)
    return f"{low} .. {high}.x"


def _module_version(core) -> str | None:
    info = sys.modules.get(INFO_MODULE)
    if info is None and core is not None:
        try:  # every release imports it first in megatron/core/__init__.py; a fork might not
            info = importlib.import_module(INFO_MODULE)
        except Exception:
            info = None
    version = getattr(info, "__version__", None) or getattr(core, "__version__", None)
    return version if isinstance(version, str) and version else None


def _read_package_info(core_dir: str) -> str | None:
    path = os.path.join(core_dir, "package_info.py")
    if not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location("_coc_inject_megatron_package_info", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # a broken file is an unknown version, not a failed status
        return None
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) and version else None


def _package_dir(module) -> str | None:
    for entry in getattr(module, "__path__", None) or ():
        return os.path.abspath(entry)
    return None


def _with_origin(version: str | None, core_dir: str | None) -> Megatron:
    installed = _installed_distribution()
    owns = installed is not None and core_dir is not None and _same_dir(installed[1], core_dir)
    if version is None and owns:
        version = installed[0]
    label = f"{DISTRIBUTION} {installed[0]}" if installed is not None else None
    return Megatron(version, core_dir, distribution=label if owns else None,
                    shadowed=None if owns or installed is None else f"{label} ({installed[1]})")


def _installed_distribution() -> tuple | None:
    """(version, megatron/core directory) of the installed megatron-core distribution, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution(DISTRIBUTION)
    except (ImportError, PackageNotFoundError):
        return None
    except Exception:  # broken metadata: as if not installed
        return None
    return dist.version, os.path.abspath(str(dist.locate_file(os.path.join("megatron", "core"))))


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
