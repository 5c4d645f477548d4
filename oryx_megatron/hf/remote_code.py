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

A model of a mixer plugin's mixer (config/plugins.py) carries the plugin's modules the same way, ``oryx_lanorm`` as
``oryx_plugin_oryx_lanorm.py``, and the folder's ``oryx_config_plugins.py`` imports them (``carried_plugins``). A
plugin module may import torch, the standard library, this package and its own package: a folder has no more.

    files = model_code(plugins)   # {file name: source}; plugins: name -> entry point ("module:attribute")
    code_hash(files)              # what config.json records (``oryx.code_sha256``)
"""

import ast
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

PACKAGE = "oryx_megatron"
# This module's root package: oryx_megatron, or the package transformers imports a folder's modules under.
ROOT = PACKAGE if __name__ == f"{PACKAGE}.hf.remote_code" else __package__
ENTRIES = {"hf.modeling": "modeling_oryx", "hf.configuration": "configuration_oryx"}  # module -> auto_map's file
MAX_LINE = 120


PLUGINS_MODULE = f"{PACKAGE}.config.plugins"
CARRIED_MARKER = "    return {}  # the folder's plugins (hf.remote_code)\n"
TRAVELS = {"torch", PACKAGE}  # what a plugin module may import beside the standard library and its own package


def _flat(module: str) -> str:
    """The folder's module name of ``module`` (a full name under ``ROOT``, or of a carried plugin's package)."""
    if not carried(module):
        return "oryx_plugin_" + module.replace(".", "_")
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


def _travels(module: str, roots: Tuple[str, ...]) -> bool:
    """Whether ``module`` (a full name) is under ``ROOT`` or one of the carried plugins' packages ``roots``."""
    return carried(module) or module.split(".")[0] in roots


def _imports(module: str, tree: ast.Module, roots: Tuple[str, ...]) -> List[Tuple[ast.ImportFrom, str]]:
    """Every import of a module under ``ROOT`` or ``roots`` in ``tree`` (also inside functions), with the module it
    names. ValueError names an import of a plugin's module that a folder could not satisfy."""
    found = []
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            target = _target(module, node)
            names.append(target)
            if _travels(target, roots):
                found.append((node, target))
        elif any(_travels(name, roots) for name in names):
            raise ValueError(f"hf.remote_code: {module} imports a module of {ROOT} as `import ...`; write "
                             f"`from ... import name` (the folder's modules are flat)")
        if not _travels(module, ()):  # a plugin's module
            for name in names:
                top = name.split(".")[0]
                if top not in TRAVELS and top not in sys.stdlib_module_names and top not in roots:
                    raise ValueError(f"mixer plugin module {module} imports {name!r}: an exported folder carries "
                                     f"torch, the standard library, oryx-megatron's core and the plugin alone")
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


def _carrying(source: str, plugins: Dict[str, str]) -> str:
    """The package's config/plugins.py as a folder carrying ``plugins`` has it: ``carried_plugins`` imports them
    (imports of the plugins' modules, made flat as every other)."""
    names = sorted(plugins)
    lines = [f"    from {plugins[name].split(':')[0]} import {plugins[name].split(':')[1]} as plugin_{i}\n"
             for i, name in enumerate(names)]
    returned = ", ".join(f"{name!r}: plugin_{i}" for i, name in enumerate(names))
    return source.replace(CARRIED_MARKER, "".join(lines) + f"    return {{{returned}}}\n")


def _module_code(module: str, plugins: Dict[str, str]) -> Tuple[str, List[str]]:
    """The folder's source of ``module`` and the modules under ``ROOT`` (or the plugins' packages) it imports."""
    path = Path(_spec(module).origin)
    source = path.read_text()
    if module == PLUGINS_MODULE and plugins:
        source = _carrying(source, plugins)
    tree = ast.parse(source, str(path))
    lines = source.splitlines(keepends=True)
    imported = []
    roots = tuple(value.split(":")[0].split(".")[0] for value in plugins.values())
    for node, target in sorted(_imports(module, tree, roots), key=lambda found: -found[0].lineno):  # bottom up
        start, end = node.lineno - 1, node.end_lineno - 1
        indent, tail = lines[start][:node.col_offset], lines[end][node.end_col_offset:]
        if indent.strip():
            raise ValueError(f"hf.remote_code: {path}:{node.lineno}: an import that shares its line")
        body = "\n".join(indent + line for line in _rewrite(node, target).split("\n"))
        lines[start:end + 1] = [body + tail]
        submodules = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
        imported += submodules + ([target] if len(submodules) < len(node.names) else [])
    code = "".join(lines)
    if ROOT == PACKAGE and carried(module):
        relative = path.relative_to(Path(_spec(PACKAGE).origin).parent).as_posix()
        code = (f"# Generated from oryx_megatron/{relative} by oryx_megatron.hf.remote_code (oryx-export hf): the "
                f"package's own\n# code with flat imports. Edit that file, not this one.\n" + code)
    elif ROOT == PACKAGE:
        code = (f"# Generated from the mixer plugin module {module} by oryx_megatron.hf.remote_code (oryx-export "
                f"hf), with\n# flat imports. Edit the plugin, not this file.\n" + code)
    return code, imported


def model_code(plugins: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """{file name: source} of every module the folder's two auto_map modules import, transitively; ``plugins``: the
    mixer plugins the model uses, name -> entry point ("module:attribute"), carried with theirs."""
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
        code, imported = _module_code(module, plugins or {})
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
