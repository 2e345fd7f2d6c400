"""The error family. Each message is one line that says what is wrong and what to do next.

Exit codes: 1 for a user error (``SpillError``), 2 for a usage error (argparse), 75 for a
preempted job (EX_TEMPFAIL, so a scheduler retries it).
"""

EXIT_USER = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75


class SpillError(Exception):
    """A problem the user can fix; printed as ``spill: error: <message>`` and exit code 1."""

    exit_code = EXIT_USER
    said = False  # True: the message was already printed (a preempted job's own line)


class UsageError(SpillError):
    """A command line that cannot mean anything (an unknown option, a bad value, an output that
    is one of the inputs); exit 2 like argparse's own usage errors."""

    exit_code = EXIT_USAGE


class ConfigError(SpillError):
    """A spill.yaml (or override) that does not compose, does not validate, or asks Hydra to
    run code (``spill.project.hydra_safety``)."""


class HydraRefused(ConfigError):
    """A ``hydra:`` setting refused because it could run code or write files."""


class BadOverride(ConfigError):
    """A command-line override that makes a project that composes fail (an unknown key, a bad
    value): a usage error, exit 2, like an unknown option."""

    exit_code = EXIT_USAGE


class ModelError(SpillError):
    """A model folder, file or name that cannot be used."""


class ModelNotFound(ModelError):
    """A name that resolves to nothing here."""


class UnsupportedModel(ModelError):
    """A model of a family or shape that spill does not implement."""


class TokenizerError(ModelError):
    """A missing or unreadable tokenizer or chat template."""


class DataError(SpillError):
    """An input file or row that cannot be used."""


class StoreError(SpillError):
    """A storage location that cannot be read or written."""


class EngineError(SpillError):
    """An engine that is missing or cannot run here."""
