"""The one exception a user sees: a configuration a run cannot start with.

It lives below everything else (config, model, parallel, train all raise it) so
that no module has to import a higher layer to say what is wrong.
"""


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message says what to change."""
