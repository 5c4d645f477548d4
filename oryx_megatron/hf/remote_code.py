"""The code an exported folder carries, so that ``trust_remote_code=True`` needs torch and transformers only: the
modules that ``OryxForCausalLM`` and ``OryxHFConfig`` import, generated from this package's own files (the one
core: the plain-torch mixer, its ops, the config schema), one flat module each, since transformers copies a
folder's modules through their ``from .name import`` lines and knows no subfolders:

    oryx_megatron/hf/modeling.py        -> modeling_oryx.py        (auto_map's two modules)
    oryx_megatron/hf/configuration.py   -> configuration_oryx.py
    oryx_megatron/mixer/linear/base.py  -> oryx_mixer_linear_base.py
    oryx_megatron/ops/__init__.py       -> oryx_ops.py

Only import statements change: ``from oryx_megatron.mixer.state import MixerCache`` (or ``from .state import``)
becomes ``from .oryx_mixer_state import MixerCache``, and ``from . import conv`` (a submodule) becomes
``from . import oryx_ops_conv as conv``. Run inside a loaded folder (its ``save_pretrained``), the same functions
give the folder's files back unchanged, so a saved model always carries its code.

    files = model_code()          # {file name: source}
    code_hash(files)              # what config.json records (``oryx.code_sha256``)
"""

import ast
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Dict, List, Tuple, Union

PACKAGE = "oryx_megatron"
# This module's root package: oryx_megatron, or the package transformers imports a folder's modules under.
ROOT = PACKAGE if __name__ == f"{PACKAGE}.hf.remote_code" else __package__
ENTRIES = {"hf.modeling": "modeling_oryx", "hf.configuration": "configuration_oryx"}  # module -> auto_map's file
MAX_LINE = 120


def _flat(module: str) -> str:
    """The folder's module name of ``module`` (a full name under ``ROOT``)."""
    relative = module[len(ROOT) + 1:]
    if ROOT != PACKAGE:
        return relative  # already flat
    return ENTRIES.get(relative) or "oryx_" + relative.replace(".", "_")


def _entries() -> List[str]:
    return [f"{ROOT}.{name if ROOT == PACKAGE else ENTRIES[name]}" for name in ENTRIES]


def _spec(module: str):
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"hf.remote_code: no source for module {module!r}")
    return spec


def _is_package(module: str) -> bool:
    return _spec(module).submodule_search_locations is not None


def carried(module: str) -> bool:
    """Whether a saved folder carries ``module`` (a module of this package, or of the loaded folder)."""
    return module == ROOT or module.startswith(ROOT + ".")


def _is_module(name: str) -> bool:
    """Whether ``name`` (``package.attribute``) is a module of a package under ``ROOT``."""
    package = name.rsplit(".", 1)[0]
    return _is_package(package) and importlib.util.find_spec(name) is not None


def _target(module: str, node: ast.ImportFrom) -> str:
    """The full name of the module ``node`` (in ``module``) imports from."""
    if node.level == 0:
        return node.module
    base = module if _is_package(module) else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _imports(module: str, tree: ast.Module) -> List[Tuple[ast.ImportFrom, str]]:
    """Every import of a module under ``ROOT`` in ``tree`` (also inside functions), with the module it names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(carried(alias.name) for alias in node.names):
            raise ValueError(f"hf.remote_code: {module} imports a module of {ROOT} as `import ...`; write "
                             f"`from ... import name` (the folder's modules are flat)")
        if isinstance(node, ast.ImportFrom):
            target = _target(module, node)
            if carried(target):
                found.append((node, target))
    return found


def _statement(names: List[str], source: str) -> str:
    """``from {source} import names`` within MAX_LINE, else one name per line."""
    line = f"from {source} import {', '.join(names)}"
    if len(line) <= MAX_LINE:
        return line
    return f"from {source} import (\n" + "".join(f"    {name},\n" for name in names) + ")"


def _rewrite(node: ast.ImportFrom, target: str) -> str:
    """The flat form of one import statement (unindented)."""
    names, modules = [], []
    for alias in node.names:
        if _is_module(f"{target}.{alias.name}"):
            modules.append(f"{_flat(f'{target}.{alias.name}')} as {alias.asname or alias.name}")
        else:
            names.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    statements = [_statement(names, "." + _flat(target))] if names else []
    if modules:
        statements.append(_statement(modules, "."))
    return "\n".join(statements)


def _module_code(module: str) -> Tuple[str, List[str]]:
    """The folder's source of ``module`` and the modules under ``ROOT`` it imports."""
    path = Path(_spec(module).origin)
    source = path.read_text()
    tree = ast.parse(source, str(path))
    lines = source.splitlines(keepends=True)
    imported = []
    for node, target in sorted(_imports(module, tree), key=lambda found: -found[0].lineno):  # bottom up
        start, end = node.lineno - 1, node.end_lineno - 1
        indent, tail = lines[start][:node.col_offset], lines[end][node.end_col_offset:]
        if indent.strip():
            raise ValueError(f"hf.remote_code: {path}:{node.lineno}: an import that shares its line")
        body = "\n".join(indent + line for line in _rewrite(node, target).split("\n"))
        lines[start:end + 1] = [body + tail]
        submodules = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
        imported += submodules + ([target] if len(submodules) < len(node.names) else [])
    code = "".join(lines)
    if ROOT == PACKAGE:
        relative = path.relative_to(Path(_spec(PACKAGE).origin).parent).as_posix()
        code = (f"# Generated from oryx_megatron/{relative} by oryx_megatron.hf.remote_code (oryx-export hf): the "
                f"package's own\n# code with flat imports. Edit that file, not this one.\n" + code)
    return code, imported


def model_code() -> Dict[str, str]:
    """{file name: source} of every module the folder's two auto_map modules import, transitively."""
    # transformers copies the modules a folder's module names in `from .name import` lines, per auto_map entry, into
    # a directory of its own: this line brings the model's modules beside the config's, so that a config loaded
    # from a folder finds them (here and in the folder's copy of this module)
    from oryx_megatron.hf.modeling import OryxForCausalLM  # noqa: F401

    files, todo, seen = {}, _entries(), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        code, imported = _module_code(module)
        files[_flat(module) + ".py"] = code
        todo += [name for name in imported if name not in seen]
    return dict(sorted(files.items()))


def code_hash(files: Dict[str, str]) -> str:
    """sha256 over the files' names and contents, in name order."""
    digest = hashlib.sha256()
    for name, code in sorted(files.items()):
        digest.update(name.encode() + b"\0" + code.encode() + b"\0")
    return digest.hexdigest()


def write_model_code(folder: Union[str, os.PathLike], files: Dict[str, str]) -> None:
    for name, code in files.items():
        (Path(folder) / name).write_text(code)
