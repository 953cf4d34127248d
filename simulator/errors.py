"""The one exception type for bad user input.

Library code raises ``UserError`` with a single line that names the bad value and says how to
fix it; the CLI prints that line to stderr and exits with status 2, without a traceback.
Anything else that escapes is a bug in ClusterSim, and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a one-line message naming the value and the fix."""

    def __init__(self, message: str):
        if "\n" in message:
            raise ValueError("UserError messages are one line")
        super().__init__(message)


class SimulationStalled(UserError):
    """The event loop ran out of events before every rank finished (a deadlocked schedule).

    The message lists which ranks wait on what; no partial result is returned.
    """


def validation_error_line(exc, hide_loc: tuple[str, ...] = ()) -> str:
    """One line from a pydantic ValidationError: where, what, and how to fix unknown or missing keys.

    ``hide_loc`` drops location parts a user never wrote (a discriminated union's tag).
    """
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if str(p) not in hide_loc)
    if err["type"] == "extra_forbidden":
        return f"unknown key {loc!r}: remove it or check its spelling"
    if err["type"] == "missing":
        return f"missing key {loc!r}: add it"
    msg = " ".join(str(err["msg"]).split()).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def read_yaml(path, what: str):
    """Parse a YAML file a user named; a missing or malformed file is a one-line UserError."""
    import yaml
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {str(path)!r} does not exist: check the path")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from None


def read_json(path, what: str, fix: str):
    """Parse a JSON file a user named; ``fix`` says what to do about a malformed one."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {str(path)!r} does not exist: check the path")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}): {fix}") from None
