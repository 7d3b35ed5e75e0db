"""coc-inject: Communication-over-Computation for Megatron tensor-parallel layers.

This package is imported by the interpreter bootstrap of every Python process that has
the bootstrap on PYTHONPATH, so importing it must stay cheap: no torch, no megatron,
no wrapt here. Heavy entry points are resolved lazily on first attribute access.
"""

__version__ = "0.1.0"

_LAZY = {
    "install": ("coc_inject.linears.install", "install"),
    "uninstall": ("coc_inject.linears.install", "uninstall"),
    "is_installed": ("coc_inject.linears.install", "is_installed"),
    "CocConfig": ("coc_inject.config", "CocConfig"),
    "ConfigError": ("coc_inject.config", "ConfigError"),
    "load_config": ("coc_inject.config", "load_config"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'coc_inject' has no attribute {name!r}") from None
    import importlib

    return getattr(importlib.import_module(module_name), attr)
