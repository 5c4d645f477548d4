"""Every reference in the docs resolves (README.md, docs/*.md, slurm/README.md).

What is checked, in backticked spans, the shell lines of code blocks and the targets of links:
- a repository path (its first folder one of the checkout's, or a file name of a kind the checkout holds:
  .py, .md, .yaml, .sh, .toml, .sbatch) exists; from the root, from the doc's folder, as the installed package
  lays it out (pyproject's package-dir), or, for a path that does not start at the root (`compat/cpu.py`), as
  the tail of a path of the checkout. `<name>`, `*` and `{a,b}` are patterns: each must match. A file name
  without a folder may also be one the package's code writes (`report.md`: the name is in its source);
- `module.attribute` names import (`oryx_megatron.`, a package of it, or a module of it by its own name:
  `checkpointing.load_checkpoint`); `Class.attribute` of a class of the package is an attribute of it;
  `group.key` of oryx-train's config (`data.reset_at_eod`) is a key of its schema; a name the code gives as a
  string (a logger's, an entry point group's) counts too;
- a test `file.py::name` (or `test_name` alone) is defined in its file;
- a command of pyproject's [project.scripts] (also `python -m` / `torchrun -m` of its module, and `sbatch` of
  the slurm scripts, which pass their arguments to oryx-train) is given only flags its `--help` shows, a
  subcommand it has, overrides that are keys of the config and recipes that exist; `make` targets exist;
- a recipe's name (`oryx_tg_1_4b`, `e4_axes_small`, `recipe/oryx_tg_130m`) is a file of recipes/.
What is not a reference of the repository is left alone: paths of what the code writes (`runs/...`), of other
projects (link their text: [`tools/preprocess_data.py`](https://github.com/...)), names of other packages.
"""

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import fields, is_dataclass
from fnmatch import fnmatchcase
from functools import cached_property, lru_cache
from itertools import product
from pathlib import Path, PurePosixPath
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "slurm/README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
CHECKED_SUFFIXES = {".py", ".md", ".yaml", ".sh", ".toml", ".sbatch"}
FILE_SUFFIXES = CHECKED_SUFFIXES | {".json", ".jsonl", ".csv", ".npy", ".log", ".png", ".txt", ".gz", ".bin",
                                    ".idx", ".safetensors", ".pt", ".distcp", ".whl", ".yml", ".out", ".sha256"}
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
HYDRA_COMMANDS = {"oryx-train", "oryx-params"}  # arguments: overrides of oryx-train's config (recipes/)
PACKAGE = "oryx_megatron"
# Not references of the repository, written as if they were: the docs' examples of bad input, and a file name
# that oryx-export composes (oryx_megatron/hf/remote_code.py: a module's path as one flat `oryx_<path>.py`).
NOT_REFERENCES = {"train.micro_batch_sise=4", "model=nope", "oryx_ops_ssd.py"}
VLLM_PLUGIN = ("oryx_vllm", "serving/vllm/oryx_vllm")  # not importable here (vLLM's own venv): read as source


class Repository:
    """What the references resolve against: the checkout's files, its console scripts, its config schema."""

    def __init__(self, root: Path = ROOT):
        self.root, self._helper = root, None  # _helper: the child of ``help``
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.split("\n")
        self.files = {f for f in listed if f and (root / f).exists()}
        self.dirs = {str(PurePosixPath(f).parents[i]) for f in self.files
                     for i in range(len(PurePosixPath(f).parents) - 1)}
        self.top = {f.split("/")[0] for f in self.files}
        project = (root / "pyproject.toml").read_text()  # read without tomllib (Python >= 3.11 only)
        scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:\n\n|\n\[)", project, re.S | re.M).group(1)
        self.scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', scripts, re.M))
        dirs = re.search(r"^package-dir = \{(.*)\}", project, re.M).group(1)
        self.package_dirs = dict(re.findall(r'"([\w.]+)" = "([\w./]+)"', dirs))  # {"oryx_megatron.recipes": "recipes"}

    # ---- paths ----
    def path_exists(self, ref: str, doc: str) -> bool:
        """``ref`` (braces, <placeholders> and * expanded) names files or folders of the checkout."""
        ref = ref.rstrip("/")
        alternatives = [""]
        for part in re.split(r"(\{[^}]*\})", ref):
            options = part[1:-1].split(",") if part.startswith("{") else [part]
            alternatives = [a + o for a, o in product(alternatives, options)]
        return all(self._exists(re.sub(r"<[^>]*>", "*", a), doc) for a in alternatives)

    def _exists(self, ref: str, doc: str) -> bool:
        names = self.files | self.dirs
        candidates = [ref, str(PurePosixPath(doc).parent / ref)]
        for package, folder in self.package_dirs.items():
            installed = package.replace(".", "/")
            if ref.startswith(installed):
                candidates.append(folder + ref[len(installed):])
        if ref.split("/")[0] not in self.top:  # a tail: `compat/cpu.py`, `registry.py`
            candidates.append("*/" + ref)
        candidates = [str(PurePosixPath(*[p for p in c.split("/") if p not in ("", ".")])) if ".." not in c
                      else _normalize(c) for c in candidates]
        return any(any(fnmatchcase(n, c) for n in names) if "*" in c else c in names for c in candidates)

    def written(self, name: str) -> bool:
        """A file name the package's code writes: the name appears in its source, or, for a pattern of names
        (`oryx_plugin_<module>.py`), each fixed piece of it does."""
        pieces = [p for p in re.split(r"<[^>]*>|\*", name) if p not in ("", ".")]
        return bool(pieces) and all(piece in self.source_text for piece in pieces)

    @cached_property
    def source_text(self) -> str:
        return "\n".join((self.root / f).read_text() for f in self.modules.values())

    def is_repository_path(self, ref: str) -> bool:
        first = ref.split("/")[0]
        return first in self.top or (first not in ("", "~", ".") and PurePosixPath(ref).suffix in CHECKED_SUFFIXES
                                     and not first.startswith(("$", "<")))

    # ---- tests ----
    def test_names(self, file: str) -> set:
        tree = ast.parse((self.root / file).read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        return names

    @cached_property
    def all_test_names(self) -> set:
        return {n for f in self.files if f.startswith("tests/") and f.endswith(".py") for n in self.test_names(f)}

    # ---- Python names ----
    @cached_property
    def modules(self) -> dict:
        """Dotted name of every module of the package (the checkout's folders mapped as it installs them)."""
        folders = {PACKAGE: PACKAGE, **self.package_dirs}
        found = {}
        for package, folder in folders.items():
            for f in self.files:
                if f.startswith(folder + "/") and f.endswith(".py"):
                    parts = PurePosixPath(f[len(folder) + 1:]).with_suffix("").parts
                    parts = parts[:-1] if parts[-1] == "__init__" else parts
                    found[".".join((package, *parts))] = f
        return found

    @cached_property
    def classes(self) -> dict:
        """Class name -> the modules of the package that define it."""
        found = {}
        for module, f in self.modules.items():
            for node in ast.walk(ast.parse((self.root / f).read_text())):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append((module, node))
        return found

    def python_name(self, name: str) -> Optional[bool]:
        """True: it resolves; False: it names the project's code but does not resolve; None: not the project's."""
        first, _, rest = name.partition(".")
        resolved = self._project_name(name)
        if not resolved and first not in self.modules and importlib.util.find_spec(first) is not None:
            return _imports(name)  # another package's name (`torch.compile`): it imports
        return resolved

    def _project_name(self, name: str) -> Optional[bool]:
        first, _, rest = name.partition(".")
        if first == VLLM_PLUGIN[0]:
            module, _, attr = name.rpartition(".")
            folder = self.root / VLLM_PLUGIN[1] / module.partition(".")[2].replace(".", "/")
            path = folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")
            return path.exists() and (attr in _top_level_names(path) or (path.parent / f"{attr}.py").exists())
        if first == PACKAGE:
            return _imports(name)
        modules = [m for m in self.modules if m.split(".")[-1] == first]
        if modules:
            return any(_imports(m + "." + rest) for m in modules)
        if first in self.classes and rest:
            attr = rest.split(".")[0]
            return any(_class_has(module, node, attr) for module, node in self.classes[first])
        return None

    # ---- the config ----
    @cached_property
    def config_groups(self) -> dict:
        from oryx_megatron.run_config import TrainConfig
        return {f.name: typing.get_type_hints(TrainConfig)[f.name] for f in fields(TrainConfig)}

    def config_key(self, key: str) -> bool:
        node = self.config_groups.get(key.split(".")[0])
        for part in key.split(".")[1:]:
            if not is_dataclass(node):
                return node is not None and typing.get_origin(node) is dict  # a dict holds any key
            hints = typing.get_type_hints(node)
            if part not in hints:
                return False
            node = hints[part]
        return True

    def recipe(self, group: str, name: str) -> bool:
        """Each of ``name``'s comma-separated recipes (<placeholders> and * match any) is in recipes/<group>/."""
        patterns = [f"recipes/{group}/{re.sub(r'<[^>]*>', '*', n)}.yaml" for n in name.split(",") if n != "null"]
        return all(any(fnmatchcase(f, p) for f in self.files) for p in patterns)

    # ---- commands ----
    @lru_cache(maxsize=None)
    def help(self, command: str, subcommand: Optional[str] = None) -> Tuple[int, str]:
        """(exit code, what `command [subcommand] --help` prints), asked of one child process (``serve_help``) that
        imports the commands once: what a command's --help does to its process (Hydra's configures logging) stays
        there (run in pytest's process under Python 3.12, it closed a stream pytest's capture still wrote to)."""
        if self._helper is None:
            child = f"import sys; sys.path.insert(0, {str(self.root)!r}); from tests.test_docs_references import " \
                    "serve_help; serve_help()"
            self._helper = subprocess.Popen([sys.executable, "-c", child], cwd=self.root, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True)
        self._helper.stdin.write(json.dumps([command, subcommand]) + "\n")
        self._helper.stdin.flush()
        code, text = json.loads(self._helper.stdout.readline())
        return code, text

    def close(self) -> None:
        """Ends the child of ``help``."""
        if self._helper is not None:
            self._helper.stdin.close()
            self._helper.wait(timeout=60)
            self._helper = None

    @cached_property
    def make_targets(self) -> set:
        text = (self.root / "Makefile").read_text()
        variables = dict(re.findall(r"^(\w+)\s*:?=\s*(\S+)\s*$", text, re.M))
        targets = set()
        for line in re.findall(r"^([^\s#=:][^=:]*):(?!=)", text, re.M):
            for target in line.split():
                targets.add(re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), target))
        return targets


def serve_help() -> None:
    """The child of ``Repository.help``: answers each line [command, subcommand] of stdin with a line [exit code,
    --help text] (oryx-train's --hydra-help too), each command run in this process as its console script runs it."""
    scripts, answers = Repository().scripts, sys.stdout
    for line in sys.stdin:
        command, subcommand = json.loads(line)
        module, function = scripts[command].split(":")
        main = getattr(importlib.import_module(module), function)
        texts, code = [], 0
        for flag in ("--help", "--hydra-help") if command == "oryx-train" else ("--help",):
            out, argv = io.StringIO(), sys.argv
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    code = main([*([subcommand] if subcommand else []), flag]) or 0
                except SystemExit as e:
                    code = e.code or 0
                finally:
                    sys.argv = argv
            texts.append(out.getvalue())
        answers.write(json.dumps([code, "\n".join(texts)]) + "\n")
        answers.flush()


def _normalize(path: str) -> str:
    parts = []
    for p in path.split("/"):
        if p == "..":
            parts = parts[:-1] if parts else [".."]
        elif p not in ("", "."):
            parts.append(p)
    return "/".join(parts)


def _imports(name: str) -> bool:
    """``name`` is a module, or an attribute of the longest module prefix of it."""
    parts = name.removesuffix("()").split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _class_has(module: str, node: ast.ClassDef, attr: str) -> bool:
    """The class defines ``attr``, inherits it, or sets ``self.attr`` in a method."""
    cls = getattr(importlib.import_module(module), node.name, None)
    if cls is not None and (hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {})):
        return True
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
               and n.value.id == "self" or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("register_buffer", "register_parameter") and n.args
               and isinstance(n.args[0], ast.Constant) and n.args[0].value == attr for n in ast.walk(node))


def _top_level_names(path: Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


# ---- reading a doc ----
def references(text: str) -> Iterator[Tuple[int, str, str]]:
    """(line, kind, text) of each reference: kind "span" (backticked), "shell" (a code block's command line),
    "link" (a link's target)."""
    fence, block = None, []
    prose = []  # the text outside code blocks, with the line each piece starts on
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        marker = re.match(r"^\s*(```|~~~)\s*(\S*)", line)
        if marker and fence is None:
            fence, language, block = marker.group(1), marker.group(2), []
        elif marker and line.strip() == fence:
            if language in SHELL_FENCES:
                yield from _shell_lines(block)
            fence = None
        elif fence is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    joined = "\n".join(line for _, line in prose)
    line_of = [n for n, line in prose for _ in range(len(line) + 1)]
    external = [m.span(1) for m in re.finditer(r"\[((?:[^\]\[]|\[[^\]]*\])*)\]\((?:https?|mailto):[^)]*\)", joined)]
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        if not any(start <= m.start() < end for start, end in external):
            yield line_of[m.start()], "span", " ".join(m.group(1).split())
    for m in re.finditer(r"\]\(([^)\s]+)\)", joined):
        if not re.match(r"[a-z]+:|#", m.group(1)):
            yield line_of[m.start()], "link", m.group(1).split("#")[0]


def _shell_lines(block: List[Tuple[int, str]]) -> Iterator[Tuple[int, str, str]]:
    start, pending = None, ""
    for number, line in block:
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, "shell", pending + line
        start, pending = None, ""


def split_commands(line: str) -> List[List[str]]:
    """The words of each command of a shell line (split at ;, &&, ||, |; comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: a fragment of a command
        words = line.split("#")[0].split()
    commands, current = [], []
    for word in words:
        if word and set(word) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in commands + [current] if c]


# ---- checking ----
FAMILY = r"(oryx_tg|oryx_tm|transformer|gdn|mamba2)(_hybrid\d+)?"
RECIPE_NAME = re.compile(rf"tiny_{FAMILY}|{FAMILY}_(130m|370m|760m|1_4b)|[ae]\d+_\w+|routing_\w+")
TEST_REF = re.compile(r"([\w./-]+\.py)::([\w:]+)(\[.*\])?")


class Checker:
    def __init__(self, repo: Repository):
        self.repo = repo

    def problems(self, doc: str, text: str) -> List[str]:
        found = []
        for line, kind, ref in references(text):
            if kind == "link":
                problem = None if self.repo.path_exists(ref, doc) else "no such file"
            elif kind == "shell":
                problem = self.shell(ref, doc)
            else:
                problem = self.span(ref, doc)
            if problem:
                found.append(f"{doc}:{line}: `{ref}`: {problem}")
        return found

    def span(self, ref: str, doc: str) -> Optional[str]:
        if ref in NOT_REFERENCES:
            return None
        test = TEST_REF.fullmatch(ref)
        if test:
            return self.test(test.group(1), test.group(2), doc)
        if self._command_words(ref.split()[0]) and (" " in ref or ref in self.repo.scripts):
            return self.shell(ref, doc)
        if " " in ref:
            return None
        if re.fullmatch(r"\+{0,2}[\w./]+=\S*", ref) and ref.lstrip("+").split("=")[0].split(".")[0] in (
                *self.repo.config_groups, *self._recipe_groups()):
            return self.override(ref, "oryx-train")
        if re.fullmatch(r"test_\w+", ref):
            return None if ref in self.repo.all_test_names else "no test of that name"
        if RECIPE_NAME.fullmatch(ref):
            group = "experiment" if re.match(r"[ae]\d|routing_", ref) else "model"
            return None if self.repo.recipe(group, ref) else f"no recipe recipes/{group}/{ref}.yaml"
        group = re.fullmatch(r"(recipe|model|experiment)/(\w+)", ref)
        if group:
            return None if self.repo.recipe(*group.groups()) else "no such recipe"
        if self._looks_like_path(ref):
            return None if not self.repo.is_repository_path(ref) or self.repo.path_exists(ref, doc) or (
                "/" not in ref and self.repo.written(ref)) or self._installed(ref) else "no such file"
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?", ref) and not re.search(r"\.(weight|bias)$", ref):
            return self.python_name(ref.removesuffix("()"))  # (a parameter's name, `lm_head.weight`, is not one)
        return None

    @staticmethod
    def _installed(ref: str) -> bool:
        """A path inside an installed package (`megatron/core/datasets/gpt_dataset.py`)."""
        first = ref.split("/")[0]
        spec = importlib.util.find_spec(first) if first.isidentifier() else None
        return bool(spec and spec.submodule_search_locations
                    and (Path(list(spec.submodule_search_locations)[0]).parent / ref).exists())

    @staticmethod
    def _looks_like_path(ref: str) -> bool:
        return bool(re.fullmatch(r"[\w.\-/<>*{},~$+@]+", ref)) and (
            "/" in ref or PurePosixPath(ref).suffix in FILE_SUFFIXES)

    def python_name(self, name: str) -> Optional[str]:
        first = name.split(".")[0]
        resolved = self.repo.python_name(name)
        if resolved is False and first in self.repo.config_groups and self.repo.config_key(name):
            return None  # `data.reset_at_eod`: a key, where `data` is also a package
        if resolved is None and first in self.repo.config_groups:
            return None if self.repo.config_key(name) else "no such key of oryx-train's config"
        if resolved is False and re.search(rf"""["']{re.escape(name)}["']""", self.repo.source_text):
            return None  # a name the code gives as a string: a logger's, an entry point group's
        return "does not resolve" if resolved is False else None

    def test(self, file: str, name: str, doc: str) -> Optional[str]:
        if not self.repo.path_exists(file, doc):
            return "no such file"
        return None if name in self.repo.test_names(file) else f"no test {name} in {file}"

    def _recipe_groups(self) -> set:
        return {d[len("recipes/"):] for d in self.repo.dirs if d.startswith("recipes/")}

    def override(self, word: str, command: str) -> Optional[str]:
        key, _, value = word.lstrip("+~").partition("=")
        if key in self._recipe_groups():
            return None if self.repo.recipe(key, value) else f"no recipe {value} in recipes/{key}/"
        if key.startswith("hydra"):
            return None
        return None if self.repo.config_key(key) else f"{key} is no key of {command}'s config"

    def _command_words(self, word: str) -> Optional[str]:
        name = word.rsplit("/", 1)[-1]
        if name in self.repo.scripts or name in ("make", "sbatch", "torchrun") or re.fullmatch(r"python3?(\.\d+)?",
                                                                                                name):
            return name
        return None

    def shell(self, line: str, doc: str) -> Optional[str]:
        problems = []
        for words in split_commands(line):
            while words and re.fullmatch(r"\w+=\S*|time|env|srun|nohup", words[0]):
                words = words[1:]
            if words:
                problems += self.command(words, doc)
        return "; ".join(problems) or None

    def command(self, words: List[str], doc: str) -> List[str]:
        name, args = self._command_words(words[0]), words[1:]
        problems = [f"no such file {w}" for w in words
                    if self.repo.is_repository_path(w) and self._looks_like_path(w) and not TEST_REF.fullmatch(w)
                    and not self.repo.path_exists(w, doc)]
        problems += [f"no test {w}" for w in args if TEST_REF.fullmatch(w) and self.span(w, doc)]
        if name == "make":
            return problems + [f"no make target {w}" for w in args
                               if not w.startswith("-") and "=" not in w and w not in self.repo.make_targets]
        if name in ("torchrun", "python", "python3") or (name or "").startswith("python"):
            if "-m" not in args:
                return problems
            module, args = args[args.index("-m") + 1], args[args.index("-m") + 2:]
            scripts = {target.split(":")[0]: script for script, target in self.repo.scripts.items()}
            if module in scripts:
                name = scripts[module]
            elif module.split(".")[0] in (PACKAGE, "benchmarks", "tests"):
                return problems + ([] if _imports(module) else [f"no module {module}"])
            else:
                return problems
        if name == "sbatch":
            script = next((i for i, w in enumerate(args) if w.endswith(".sbatch")), None)
            if script is None:
                return problems
            name, args = "oryx-train", [w for w in args[script + 1:] if "=" in w and not w.startswith("-")]
        if name not in self.repo.scripts:
            return problems
        return problems + self.arguments(name, args)

    def arguments(self, command: str, args: List[str]) -> List[str]:
        problems, subcommand = [], None
        code, text = self.repo.help(command)
        usage = text.split("\n\n")[0]
        if args and not args[0].startswith("-") and re.search(r"(\}|[A-Z]+) \.\.\.\s*$", usage, re.M):
            subcommand = args[0]
            code, text = self.repo.help(command, subcommand)
            if code != 0:
                return [f"{command} has no subcommand {subcommand}"]
        if command == "oryx-experiment" and args and "=" not in args[0] and not args[0].startswith("-"):
            if not self.repo.recipe("experiment", args[0]):
                problems.append(f"no experiment recipes/experiment/{args[0]}.yaml")
        for word in args:
            flag = word.split("=")[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", flag):
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    problems.append(f"{command} --help shows no {flag}")
            elif (command in HYDRA_COMMANDS or command == "oryx-experiment") and re.fullmatch(
                    r"[+~]{0,2}[\w./]+=.*", word):
                problems += filter(None, [self.override(word, command)])
        return problems


def paths_outside(repo: Repository) -> List[str]:
    """'file:line: path' for each relative path (../...) in a text file of the checkout that leads out of it or to
    nothing: a clone holds only the repository."""
    found = []
    for f in sorted(repo.files):
        if PurePosixPath(f).suffix not in CHECKED_SUFFIXES | {".cfg", ".txt", ""} or f.startswith("tests/fixtures/"):
            continue
        for number, line in enumerate((repo.root / f).read_text(errors="replace").split("\n"), 1):
            for m in re.finditer(r"(?<![.\w/])(\.\./)+\w[\w.-]*", line):
                target = _normalize(str(PurePosixPath(f).parent / m.group(0)))
                if target.startswith("..") or target.rstrip("/") not in repo.files | repo.dirs:
                    found.append(f"{f}:{number}: {m.group(0)}")
    return found


@pytest.fixture(scope="module")
def checker():
    repo = Repository()
    yield Checker(repo)
    repo.close()


def test_every_reference_in_the_docs_resolves(checker):
    problems = [p for doc in DOCS for p in checker.problems(doc, (ROOT / doc).read_text())]
    assert problems == [], "\n".join(problems)


def test_no_file_names_a_path_outside_the_repository(checker):
    assert paths_outside(checker.repo) == []


# A doc with one reference of each kind, good then broken: each broken one is found, and only those.
GOOD_AND_BROKEN = [
    ("`oryx_megatron/mixer/oryx_mixer.py`", "`oryx_megatron/mixer/oryx_mixerz.py`"),
    ("`compat/cpu.py`", "`training/config.py`"),
    ("`recipes/experiment/<name>.yaml`", "`recipes/experimentz/<name>.yaml`"),
    ("[the data](data.md)", "[the data](dataz.md)"),
    ("`oryx_megatron.mixer.OryxMixer`", "`oryx_megatron.mixer.OryxMixerz`"),
    ("`oryx_megatron.train`", "`oryx_megatron.trainz`"),  # a logger's name
    ("`report.md`", "`reportz.md`"),  # a file the GPU check writes
    ("`ops.causal_conv1d`", "`ops.once_per_tensor`"),
    ("`oryx_vllm.requests.ScheduleTracker`", "`oryx_vllm.requests.ScheduleTrackerz`"),  # the vLLM plugin, read
    ("`checkpointing.load_checkpoint`", "`checkpointing.load_checkpointz`"),
    ("`OryxMixer.step`", "`OryxMixer.stepz`"),
    ("`data.reset_at_eod`", "`data.reset_at_eodz`"),
    ("`tests/test_structure.py::test_imports_run_downward_only`", "`tests/test_structure.py::test_imports_run_up`"),
    ("`test_imports_run_downward_only`", "`test_imports_run_upward_only`"),
    ("`oryx-eval --context-parallel 2`", "`oryx-eval --context-parallelz 2`"),
    ("`oryx-prep tokenize --stdlib`", "`oryx-prep tokenizez --stdlib`"),
    ("`oryx_tg_1_4b`", "`gdn_hybrid8_130m`"),
    ("`recipe/oryx_tg_130m`", "`recipe/oryx_tg_131m`"),
    ("`model.layer_pattern=OOOO`", "`model.layer_patternz=OOOO`"),
    ("```bash\n.venv/bin/oryx-train recipe=oryx_tg_130m router.hidden=64\n```",
     "```bash\n.venv/bin/oryx-train recipe=oryx_tg_130mz router.hiddenz=64\n```"),
    ("```bash\noryx-experiment e1_retrieval --seeds 1 2\n```", "```bash\noryx-experiment e1_retrievalz --seedz 1\n```"),
    ("```bash\nsbatch slurm/train.sbatch recipe=oryx_tg_130m\n```", "```bash\nsbatch slurm/trainz.sbatch\n```"),
    ("```bash\nmake demo && make test-kernels\n```", "```bash\nmake demoz\n```"),
    ("```bash\ntorchrun --nproc-per-node 2 -m oryx_megatron.cli.train checkpoint.dir=x\n```",
     "```bash\ntorchrun --nproc-per-node 2 -m oryx_megatron.cli.train checkpoint.dirz=x\n```"),
    ("```bash\npython -m pytest tests/test_structure.py::test_imports_run_downward_only\n```",
     "```bash\npython -m oryx_megatron.checks.sessionz\n```"),
]
UNCHECKED = ("`runs/demo/checkpoints` `~/.cache/oryx-megatron` `torch.compile` `train/loss` `--no-deps` "
                  "[`tools/preprocess_data.py`](https://github.com/NVIDIA/Megatron-LM) `router/*` `lm_head.weight`")


def test_the_check_finds_each_kind_of_broken_reference(checker):
    good = "\n\n".join(g for g, _ in GOOD_AND_BROKEN) + "\n\n" + UNCHECKED
    assert checker.problems("docs/probe.md", good) == []
    for good_ref, broken in GOOD_AND_BROKEN:
        problems = checker.problems("docs/probe.md", f"{UNCHECKED}\n\n{broken}\n")
        assert len(problems) == 1, (broken, problems)
