"""The ``COC_*`` settings as data: one table row per setting, and what is derived from it.

``table`` holds the rows (variable, CocConfig field, file key, MindSpeed flag, kind, default,
allowed text, meaning, agreed across ranks, arms the bootstrap); ``kinds`` reads and checks each
kind of value, with the plain parsers of ``parsers``; ``rules`` holds the few rules that span
fields; ``coc_config`` builds CocConfig from the rows; ``argv`` takes MindSpeed's flags out of the
command line; ``resolve`` merges the environment, the ``COC_CONFIG`` file and the flags.
``coc_inject.config`` re-exports the names the rest of the package uses. All of it is stdlib-only
and cheap to import: the config is read before torch is.
"""
