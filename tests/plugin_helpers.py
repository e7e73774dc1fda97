"""Helpers shared by the plugin and dispatch tests."""

from portakern import hookimpl


def provides(*backends):
    """A plugin object whose ``portakern_register_backends`` returns ``backends``."""

    class Plugin:
        @hookimpl
        def portakern_register_backends(self):
            return list(backends)

    return Plugin()
