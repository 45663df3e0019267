"""Where each run config key is read: the scan behind agora-core's test_config_honest.py.

    python tools/config_reads.py            # every key and the first places that read it

(the tool runs ``agora_devkit.config_reads.main``.)

Every key of the run config must be read by the code or listed in
``agora_core.config.unimplemented.NOT_IMPLEMENTED`` (refused when a config sets it); the
command exits 1 naming the keys that are neither, and listed keys the code now reads.

The scan parses the packages' sources (``packages/*/src``) and ``tools/`` with ``ast`` and
collects the reads of config fields. A read of ``<section>.<field>`` is an attribute load
``x.field`` (or ``getattr(x, "field")``) where ``x`` is known to hold that section's dataclass:

* a name or ``self.<attr>`` annotated with the class (``config: AveragingConfig``,
  ``limits: StoreLimits | None`` does not count), or assigned from such an expression
  (``self._config = config``, ``m = run.model``);
* a section reached through its parent (``run.averaging``, ``self.config.surrogate``);
* a call that returns the class: its constructor, or a function annotated ``-> RunConfig``;
* by the project's convention, an unannotated ``run``/``_run`` name or attribute is the run's
  ``RunConfig`` (``Worker.run``, ``Trainer.run``, ``Joiner._run``).

Shared field names (``enabled``, ``seed``, ``kind``) therefore count only where the receiver
is a config: ``policy.enabled`` or ``message.kind`` do not. What does not count as a use:
the config classes' own bodies (``__post_init__`` validation, the cross-section checks of
``RunConfig``), and ``agora config check``'s summary, which only displays values. A method or
property of a config class (``ClippingConfig.threshold``, ``ModelConfig.n_stages``) reads the
fields it touches through ``self`` when the method itself is read.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from collections import defaultdict
from pathlib import Path

from agora_core.config import RunConfig
from agora_core.config.unimplemented import NOT_IMPLEMENTED
from agora_localswarm import checkout

RUN_PY = "packages/agora-core/src/agora_core/config/run.py"
# Where the config dataclasses are defined: their own methods may read their fields.
CONFIG_MODULES = (
    RUN_PY,
    "packages/agora-core/src/agora_core/config/lifecycle.py",
    "packages/agora-core/src/agora_core/config/admission.py",
    "packages/agora-core/src/agora_core/config/operator.py",
)
DISPLAY_ONLY = {"packages/agora-core/src/agora_core/cli.py": {"config_check"}}
RUN_NAMES = {"run", "_run"}


def config_classes(root: type = RunConfig) -> dict[str, type]:
    """Every config dataclass reachable from ``root`` through dataclass-typed fields."""
    found = {root.__name__: root}
    for f in dataclasses.fields(root):
        tp = typing.get_type_hints(root)[f.name]
        if dataclasses.is_dataclass(tp):
            found |= config_classes(tp)
    return found


def leaf_keys(root: type = RunConfig, path: str = "") -> dict[str, tuple[str, str]]:
    """Dotted key of every non-section field -> (its class's name, the field's name)."""
    keys: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(root):
        tp = typing.get_type_hints(root)[f.name]
        dotted = f"{path}.{f.name}" if path else f.name
        keys |= leaf_keys(tp, dotted) if dataclasses.is_dataclass(tp) else {dotted: (root.__name__, f.name)}
    return keys


class ReadScanner:
    """Collects ``(config class name, member name) -> ["path:line", ...]`` from sources."""

    def __init__(self, classes: dict[str, type]):
        self.classes = classes
        self.sections = {  # class -> {section field -> its class}
            name: {
                f.name: tp.__name__
                for f in dataclasses.fields(cls)
                if dataclasses.is_dataclass(tp := typing.get_type_hints(cls)[f.name])
            }
            for name, cls in classes.items()
        }
        self.returns: dict[str, str] = {}  # function name -> the config class it is annotated to return
        self.reads: dict[tuple[str, str], list[str]] = defaultdict(list)

    # --- types -----------------------------------------------------------------------------------

    def annotated(self, annotation: ast.expr | None) -> str | None:
        """The config class an annotation names (``C``, ``C | None``, ``"C"``), if exactly one."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
        hits = names & self.classes.keys()
        return hits.pop() if len(hits) == 1 else None

    def typeof(self, node: ast.expr, env: dict[str, str], attrs: dict[str, str]) -> str | None:
        if isinstance(node, ast.Name):
            return env.get(node.id, "RunConfig" if node.id in RUN_NAMES else None)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in attrs:
                return attrs[node.attr]
            owner = self.typeof(node.value, env, attrs)
            if owner is not None:
                return self.sections[owner].get(node.attr)
            return "RunConfig" if node.attr in RUN_NAMES else None
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in self.classes:
                return name
            if name == "replace" and node.args:
                return self.typeof(node.args[0], env, attrs)
            return self.returns.get(name)
        if isinstance(node, ast.BoolOp):  # settings or RunConfig()
            return next((t for v in node.values if (t := self.typeof(v, env, attrs))), None)
        return None

    def bind(
        self, body: list[ast.AST], env: dict[str, str], attrs: dict[str, str], *, into_self: bool
    ) -> None:
        """Names (and ``self.<attr>``s when ``into_self``) assigned a config in ``body``."""
        for node in _own_nodes(body):
            if isinstance(node, ast.Assign):
                targets, value_type = node.targets, self.typeof(node.value, env, attrs)
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
                value_type = self.annotated(node.annotation) or (
                    self.typeof(node.value, env, attrs) if node.value else None
                )
            else:
                continue
            if value_type is None:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    env[target.id] = value_type
                elif into_self and _is_self_attr(target):
                    attrs[target.attr] = value_type

    def function_env(self, fn, outer: dict[str, str], attrs: dict[str, str], *, into_self: bool):
        env = dict(outer)
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            typed = self.annotated(arg.annotation)
            if typed is not None:
                env[arg.arg] = typed
            elif arg.arg not in RUN_NAMES:
                env.pop(arg.arg, None)  # a parameter shadows an outer name
        if not isinstance(fn, ast.Lambda):
            for _ in range(2):  # an assignment may use one made later in the text
                self.bind(fn.body, env, attrs, into_self=into_self)
        return env

    # --- reads -----------------------------------------------------------------------------------

    def scan(self, path: str, source: str) -> None:
        tree = ast.parse(source)
        env: dict[str, str] = {}
        self.bind(tree.body, env, {}, into_self=False)
        self._visit(tree, env, {}, path, skip=DISPLAY_ONLY.get(path, set()))

    def _visit(self, node, env, attrs, path, skip) -> None:
        if isinstance(node, ast.ClassDef):
            if node.name in self.classes:
                return  # a config's own body: validation, not use (methods: see method_reads)
            attrs = {}
            for stmt in node.body:  # class-level annotations: self.<name>
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if (typed := self.annotated(stmt.annotation)) is not None:
                        attrs[stmt.target.id] = typed
            methods = [s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for _ in range(2):
                for method in methods:
                    self.function_env(method, env, attrs, into_self=True)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if getattr(node, "name", None) in skip:
                return
            env = self.function_env(node, env, attrs, into_self=False)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self._read(self.typeof(node.value, env, attrs), node.attr, path, node.lineno)
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._read(self.typeof(node.args[0], env, attrs), name.value, path, node.lineno)
        for child in ast.iter_child_nodes(node):
            self._visit(child, env, attrs, path, skip)

    def _read(self, owner: str | None, member: str, path: str, line: int) -> None:
        if owner is not None:
            self.reads[(owner, member)].append(f"{path}:{line}")

    def scan_tree(self, root: Path) -> None:
        files = sorted(root.glob("packages/*/src/**/*.py")) + sorted(root.glob("tools/**/*.py"))
        sources = {str(p.relative_to(root)): p.read_text() for p in files}
        for source in sources.values():
            for fn in ast.walk(ast.parse(source)):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (typed := self.annotated(fn.returns)) is not None:
                        self.returns[fn.name] = typed
        for path, source in sources.items():
            self.scan(path, source)
        for module in CONFIG_MODULES:
            self.credit_methods(sources[module], module)

    def credit_methods(self, source: str, path: str) -> None:
        """A read method or property of a config class reads the fields it touches via self."""
        touched: dict[tuple[str, str], set[str]] = {}
        for cls in ast.walk(ast.parse(source)):
            if isinstance(cls, ast.ClassDef) and cls.name in self.classes:
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name != "__post_init__":
                        touched[(cls.name, fn.name)] = {
                            n.attr for n in ast.walk(fn) if _is_self_attr(n) and isinstance(n.ctx, ast.Load)
                        }
        pending = [m for m in touched if m in self.reads]
        while pending:
            owner, method = pending.pop()
            for member in touched[(owner, method)]:
                first = (owner, member) not in self.reads
                self.reads[(owner, member)].append(f"{path}: via {owner}.{method}")
                if first and (owner, member) in touched:
                    pending.append((owner, member))


def _is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _own_nodes(body: list[ast.AST]):
    """The nodes of ``body``, not descending into nested functions or classes."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def scan(root: Path | None = None) -> dict[tuple[str, str], list[str]]:
    """(config class name, member) -> where it is read, over the repo at ``root`` (the checkout)."""
    root = checkout.root() if root is None else root
    scanner = ReadScanner(config_classes())
    scanner.scan_tree(root)
    return scanner.reads


def audit(reads: dict[tuple[str, str], list[str]]) -> tuple[list[str], dict[str, list[str]]]:
    """(keys read by nothing and not listed, listed keys that are read -> where)."""
    keys = leaf_keys()
    unread = [key for key, member in keys.items() if member not in reads and key not in NOT_IMPLEMENTED]
    stale = {key: reads[keys[key]] for key in NOT_IMPLEMENTED if key in keys and keys[key] in reads}
    return unread, stale


def main() -> int:
    reads = scan()
    for key, member in leaf_keys().items():
        where = reads.get(member, [])
        shown = ", ".join(where[:2]) + (f" (+{len(where) - 2})" if len(where) > 2 else "")
        print(f"{key:36} {shown or ('NOT IMPLEMENTED' if key in NOT_IMPLEMENTED else 'READ BY NOTHING')}")
    unread, stale = audit(reads)
    for key in unread:
        print(f"error: {key} is read by nothing; wire it up or list it in NOT_IMPLEMENTED", file=sys.stderr)
    for key, where in stale.items():
        print(f"error: {key} is listed in NOT_IMPLEMENTED but read at {where[0]}", file=sys.stderr)
    return 1 if unread or stale else 0
