"""The daemon's configuration: every key, its default, and how each value is parsed.

- ``config``  ``Config`` and how it is loaded (embedded defaults, TOML, environment, flags).
- ``values``  one parser per kind of value, each naming its key in its error.

May import: ``hisparse`` core modules only (errors, layout, paths). Every other layer reads it.
"""
